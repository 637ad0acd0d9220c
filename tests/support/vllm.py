"""A real vLLM for the serving tests: the engine of `tools/vllm.sh` (its own venv) on SmolLM2-135M, on a free
loopback port (probe_worker.engine.VllmProcess). conftest.py's session fixture `vllm_session` holds one `SessionVllm`;
its per-test fixture `vllm_engine` asks it for the running engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from api.server import free_port
from probe_worker.engine import EngineError, VllmProcess, vllm_installed, vllm_python

NO_VENV = ("needs the vLLM venv (bash tools/vllm.sh install; the README's test command, `bash tools/bootstrap.sh "
           "--test-services`, installs it), absent at {venv}")


class SessionVllm:
    """One vLLM per test session, started on the first test that asks for it and stopped at the session's end.

    `get()` is asked again by every test, so nothing is cached but a running engine: a missing venv skips that test
    (naming the prerequisite) and a later test finds a venv installed meanwhile; an engine that did not start fails
    that test (its log's tail in the message) and the next test starts a fresh one."""

    def __init__(self, log_dir: Path, model_dir: Callable[[], Path] | None = None) -> None:
        self.log_dir = log_dir
        self.model_dir = model_dir  # None: SmolLM2-135M (trainer.models.pretrained.smollm2_dir, converted once)
        self.engine: VllmProcess | None = None
        self.starts = 0

    def get(self) -> VllmProcess:
        """The running engine (started now if none runs). Skips without the venv; fails if it does not start."""
        if self.engine is not None and self.engine.proc is not None and self.engine.proc.poll() is None:
            return self.engine
        self.stop()
        if not vllm_installed():
            pytest.skip(NO_VENV.format(venv=vllm_python().parent.parent))
        from trainer.models.pretrained import smollm2_dir

        self.starts += 1
        engine = VllmProcess((self.model_dir or smollm2_dir)(), free_port(), self.log_dir / f"vllm-{self.starts}.log",
                             extra_args=["--enable-server-load-tracking"])
        engine.start()
        try:
            engine.wait_ready()
        except EngineError as exc:
            engine.stop()
            pytest.fail(str(exc))
        self.engine = engine
        return engine

    def stop(self) -> None:
        """Stop the engine (its whole process group) if one was started."""
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
