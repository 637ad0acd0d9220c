"""A real teacher worker process (probe_worker.teacher) on the test Redis, for the teacher-round tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def start_teacher_worker(redis_url: str, queue: str, pause_s: float = 0.0,
                         env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """A teacher worker on `queue` (Celery visibility timeout 5 s, so a killed worker's round is redelivered fast),
    in its own process group, on one CPU thread: the in-process reference then sums in the same order. `env`:
    variables set on top of this process's (e.g. SPARECYCLES_CACHE, where it keeps teachers fetched from the store);
    `args`: more options (e.g. --teacher-engine URL)."""
    return subprocess.Popen([sys.executable, "-m", "probe_worker.teacher", "--broker", redis_url, "--queue", queue,
                             "--visibility-timeout", "5", "--pause-s", str(pause_s), "--threads", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **(env or {})})


def stop_teacher_worker(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (its warm shutdown), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
