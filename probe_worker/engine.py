"""A co-located serving engine as a child process: a real vLLM started by `tools/vllm.sh start` on a loopback port.

Used by the tests (tests/support/vllm.py), `sparecycles bench serving` and `up --serving vllm`. The engine lives
in a venv of its own (`tools/vllm.sh install`), so it is always another process, never an import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
VLLM_SH = REPO / "tools" / "vllm.sh"
HEALTH_TIMEOUT_S = 300.0  # vLLM answers /health after ~40 s on an idle CPU; a shared 2-core box is much slower


def _prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # resolved before any fork: the child must not dlopen or import


def die_with_parent() -> None:
    """Runs in a child between fork and exec (Popen's preexec_fn): on Linux the child gets SIGTERM when the thread
    that started it exits, however it ends, SIGKILL included (prctl PR_SET_PDEATHSIG = 1; it survives exec, so the
    engine that `taskset` and `tools/vllm.sh start` exec into keeps it). Elsewhere: nothing. The child also gets
    the signal mask of a fresh process: a worker blocks SIGUSR1/SIGUSR2 (probe_worker.drain_signals), which an
    engine may handle itself (vLLM's API server hears of a dead engine core by SIGUSR1)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class EngineError(RuntimeError):
    """The engine exited or did not answer /health in time (the message holds its log's tail)."""


def vllm_python() -> Path:
    """The vLLM venv's python (`tools/vllm.sh python`); it may not exist yet (run `tools/vllm.sh install`)."""
    out = subprocess.run(["bash", str(VLLM_SH), "python"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def vllm_installed() -> bool:
    """Whether `tools/vllm.sh install` finished: the stamp it writes once vLLM imports in its venv."""
    return (vllm_python().parent.parent / ".sparecycles-installed").is_file()


class VllmProcess:
    """A vLLM OpenAI-compatible server on 127.0.0.1:`port` serving `model_dir`, its output in `log_path`.

    `cpus`: CPU ids it is pinned to (taskset), None for any. Use as a context manager or call `start`, `wait_ready`
    and `stop`. The process runs in its own session (vLLM starts an engine-core child), so `stop` ends them all.
    """

    def __init__(self, model_dir: Path, port: int, log_path: Path, cpus: Sequence[int] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.model_dir, self.port, self.log_path = Path(model_dir), port, Path(log_path)
        self.cpus, self.extra_args = cpus, list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL (no trailing slash): /health, /metrics, /v1/completions live under it."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The engine's Prometheus endpoint."""
        return self.url + "/metrics"

    @property
    def load_url(self) -> str:
        """vLLM's /load ({"server_load": N}: requests held, counted on arrival; needs --enable-server-load-tracking),
        what a yielding worker reads to see a request before its prefill (probe_worker.serving)."""
        return self.url + "/load"

    def command(self) -> list[str]:
        """The server's command line (before any taskset); a stand-in engine overrides it."""
        return ["bash", str(VLLM_SH), "start", str(self.model_dir), str(self.port), *self.extra_args]

    def start(self) -> None:
        """Start the server (returns at once; `wait_ready` waits for it)."""
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        cmd = [*pin, *self.command()]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         preexec_fn=die_with_parent)  # no engine outlives its starter

    def wait_ready(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Poll /health every 0.5 s until it answers 200.

        Raises EngineError if the process exits first or `timeout_s` passes (the process is then stopped).
        """
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise EngineError(f"vLLM exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise EngineError(f"vLLM did not answer /health in {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The last `chars` characters of the engine's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the engine's process group, SIGKILL after 20 s; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        try:  # children that outlived the leader (vLLM's engine core) are in the same group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None

    def __enter__(self) -> VllmProcess:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
