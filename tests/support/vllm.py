"""A real vLLM for the serving tests: the engine of `tools/vllm.sh` (its own venv) on SmolLM2-135M, on a free
loopback port (probe_worker.engine.VllmProcess). conftest.py's session fixture `vllm_engine` starts one per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.server import free_port
from probe_worker.engine import EngineError, VllmProcess, vllm_python


def running_vllm(log_dir: Path) -> Iterator[VllmProcess]:
    """Start vLLM on SmolLM2-135M (the folder trainer.models.pretrained.smollm2_dir writes; /load on), wait for /health,
    yield it, and stop it (its whole process group) at the end. Fails the test, naming the fix, when the vLLM
    venv is missing (CI's .ci/run installs it: `bash tools/vllm.sh install`)."""
    from trainer.models.pretrained import smollm2_dir

    if not vllm_python().is_file():
        pytest.fail("no vLLM venv: run `bash tools/vllm.sh install` first")
    engine = VllmProcess(smollm2_dir(), free_port(), log_dir / "vllm.log", extra_args=["--enable-server-load-tracking"])
    engine.start()
    try:
        try:
            engine.wait_ready()
        except EngineError as exc:
            pytest.fail(str(exc))
        yield engine
    finally:
        engine.stop()
