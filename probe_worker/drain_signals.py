"""The worker's local drain signals: SIGUSR1 drains, SIGUSR2 resumes, taken by a thread of their own with sigwait.

Imports only the standard library, so the worker's command can hold the signals (`hold_drain_signals`) before torch,
CUDA or Celery start a thread.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class LocalDrain(Protocol):
    """What the signals act on (probe_worker.tasks.DrainState)."""

    def set_operator_drain(self, value: bool) -> None: ...


LOCAL_DRAIN = {signal.SIGUSR1: True, signal.SIGUSR2: False}  # signal -> DrainState.set_operator_drain's value
TAKER_NAME = "drain-signals"  # the sigwait thread's kernel name (/proc/PID/task/TID/comm, at most 15 bytes)


def hold_drain_signals() -> None:
    """Block SIGUSR1 and SIGUSR2 in the calling thread, and so in every thread it starts afterwards (threads inherit
    the mask; a child process does too, harmlessly: it does not use them). Call it first in the worker process's main
    thread, before torch, CUDA or Celery start threads of their own, so that the kernel delivers these signals to no
    thread at all and `DrainSignals` takes them with sigwait.

    Why: a signal delivered to a handler can be lost to whoever replaced the handler. Triton's first compile in a
    process (an inductor compile on CUDA) installs LLVM's signal handlers with sigaction, over Python's: LLVM's
    SIGUSR1 handler is its "info" handler, which swallows the signal, so every drain after a compile was lost (a
    cached kernel compiles nothing, which is why it happened in some runs only). A blocked signal reaches no handler:
    it waits, pending, for sigwait (tests/probe_worker/test_worker_policy.py reproduces the loss with a CUDA-target
    compile)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(LOCAL_DRAIN))


def threads_taking_drain_signals(pid: int | str = "self") -> list[int]:
    """The thread ids of process `pid` that do not block SIGUSR1/SIGUSR2 (/proc/PID/task/TID/status, SigBlk): a
    drain signal could be delivered to one of them, and so to a handler. The sigwait thread (named TAKER_NAME) is
    not counted: the kernel unblocks the signals it waits for while it waits, and hands them to it, not to a
    handler. Empty when all hold them (or none is readable)."""
    bits = sum(1 << (int(sig) - 1) for sig in LOCAL_DRAIN)
    open_ = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            if (status.parent / "comm").read_text().strip() == TAKER_NAME:
                continue
            blocked = next(int(line.split(":")[1], 16) for line in status.read_text().splitlines()
                           if line.startswith("SigBlk:"))
        except (OSError, StopIteration, ValueError):
            continue
        if blocked & bits != bits:
            open_.append(int(status.parent.name))
    return open_


class DrainSignals:
    """SIGUSR1 (drain) and SIGUSR2 (resume) applied to `drain` in the order they arrived, by a thread of their own
    that takes them with sigwait, whatever the main thread does and whatever handler a library installed.

    The signals are blocked (`hold_drain_signals`, in the process's main thread before any other thread exists), so
    none reaches a handler: each stays pending until the thread's sigwait returns it, at once. Two signals pending
    at once (a stopped process) are taken lowest number first: no process can tell their order. Python-level
    handlers that apply the drain themselves stay installed as a fallback for a thread started before the block
    (said once in the log); they also replace Celery's own (SIGUSR1 is its thread dump). `install()` from the main
    thread, after Celery installed its handlers."""

    def __init__(self, drain: LocalDrain) -> None:
        self.drain = drain
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Block the signals in this thread, start the thread that takes them (once), and install the fallback
        handlers (again: a restarted Celery worker put its own back). Logs a warning naming the threads that could
        still receive a drain signal (started before `hold_drain_signals`)."""
        hold_drain_signals()
        if self._thread is None:
            self._thread = threading.Thread(target=self._take, name="sparecycles-drain-signals", daemon=True)
            self._thread.start()
            open_ = threads_taking_drain_signals()
            if open_:
                log.warning("%d thread(s) started before the drain signals were held (%s): a library that replaces "
                            "their handlers can lose a drain; call hold_drain_signals() first", len(open_), open_)
        for sig, value in LOCAL_DRAIN.items():
            signal.signal(sig, lambda *_, v=value: self.drain.set_operator_drain(v))

    def _take(self) -> None:
        try:  # named, so that a reader of /proc tells it from a thread that could run a handler
            Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(TAKER_NAME)
        except OSError:
            pass
        while True:
            sig = signal.sigwait(set(LOCAL_DRAIN))
            self.drain.set_operator_drain(LOCAL_DRAIN[sig])
