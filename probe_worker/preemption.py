"""Cutting a running task short beside a serving engine (probe_worker.serving's gate decides when): `Preemption`
arms at a task's start, is fired from the control thread, and a global forward pre-hook raises `Preempted` at the
task thread's next module call; it also keeps the worker's busy clock. `wait_for_device`: before each block of a
segmented forward, the task's queued device work is waited for, so a cut lands within one block."""

from __future__ import annotations

import threading
import time

from probe_worker.task_trace import where_in


class Preempted(BaseException):
    """Raised inside a task's forward pass when the engine needs the device (a BaseException, so that no
    `except Exception` on the evaluation path, e.g. a compile fallback, mistakes it for a failure)."""


class Preemption:
    """Cuts a running task short and keeps the worker's busy clock (monotonic seconds).

    `arm()` at a task's start (in its thread), `disarm()` at its end, `fire()` from the control thread: while fired,
    the task thread's next module call raises Preempted. `install()` adds the global forward pre-hook once (an
    Event check per module call while installed).
    """

    def __init__(self) -> None:
        self._fired = threading.Event()
        self._thread: int | None = None
        self._started = 0.0
        self._busy_done = 0.0
        self.last_end: float | None = None  # when the last task ended (monotonic s), None before any
        self.fired_at: float | None = None  # the running (or last) task's first fire (unix s), None if none
        self.armed_at: float | None = None  # when the running (or last) task started (unix s)
        self.where = ""  # where that fire found the task (its innermost project frames), for the trace
        self.stopped_at: float | None = None  # when the cut took effect: the check that raised (unix s), None if none
        self.freeze = None  # the freeze watcher's link (probe_worker.freeze.FreezeLink), None without one

    def arm(self) -> None:
        """The calling thread runs a task from now; an earlier fire is forgotten."""
        self._fired.clear()
        self.fired_at, self.where, self.armed_at, self.stopped_at = None, "", time.time(), None
        self._started = time.monotonic()
        self._thread = threading.get_ident()
        if self.freeze is not None:
            self.freeze.task_started()

    def disarm(self) -> None:
        """The task ended (however it ended)."""
        now = time.monotonic()
        if self._thread is not None:
            self._busy_done += now - self._started
        self._thread, self.last_end = None, now
        self._fired.clear()
        if self.freeze is not None:
            self.freeze.task_ended()

    def watcher_stop(self) -> float | None:
        """When the freeze watcher first stopped the running (or last) task (unix s), None if it did not or there is
        no watcher."""
        return self.freeze.stopped_at() if self.freeze is not None else None

    def in_task(self) -> bool:
        """True in the thread of the running task."""
        return self._thread is not None and threading.get_ident() == self._thread

    @property
    def armed(self) -> bool:
        """True while a task runs."""
        return self._thread is not None

    def busy_s(self, now: float) -> float:
        """Seconds spent in tasks so far, the running one's part up to `now` included."""
        return self._busy_done + (now - self._started if self._thread is not None else 0.0)

    def fire(self) -> bool:
        """Cut the running task (if any) at its next module call; returns whether one was running."""
        thread = self._thread
        if thread is None:
            return False
        if self.fired_at is None:
            self.fired_at, self.where = time.time(), where_in(thread)
        self._fired.set()
        return True

    def check(self, segment=None) -> None:
        """Raise Preempted in the task thread once fired (the forward pre-hook's body). Before `segment`, a block of
        a segmented forward (probe_kernels.compiled_forward.is_segment), on CUDA, first wait for the device work the
        task queued: at most the previous block's kernels, so a cut lands within one block and leaves nothing of
        the worker's queued on the device for the engine to wait behind."""
        if threading.get_ident() != self._thread:
            return
        if segment is not None:
            wait_for_device(segment)
        if self._fired.is_set():
            self._fired.clear()
            self.stopped_at = time.time()
            raise Preempted("the serving engine needs the device")

    def install(self):
        """Register the global forward pre-hook (torch.nn.modules.module.register_module_forward_pre_hook); returns
        its handle (`.remove()` takes it out). Inside a compiled region the hook does nothing: traced, it would put
        a guard on the fired flag, and each cut would recompile the forward."""
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook

        from probe_kernels.compiled_forward import is_segment

        def hook(module, _args) -> None:
            if not torch.compiler.is_compiling():
                self.check(module if is_segment(module) else None)

        return register_module_forward_pre_hook(hook)


def wait_for_device(module) -> None:
    """Wait until the device of `module`'s parameters has run the work queued on its current stream (CUDA only;
    nothing for a module on the CPU or without parameters)."""
    param = next(module.parameters(), None)
    if param is not None and param.is_cuda:
        import torch

        torch.cuda.current_stream(param.device).synchronize()
