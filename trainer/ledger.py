"""The time ledger of a run: where the trainer's wall time went, split into phases.

Phases (seconds of the training process's main thread, exclusive of nested phases):

- `startup`: run folder, task and model build, checkpoint restore, fleet attach work inside `train()`;
- `step`: the optimizer steps (forward, backward, update, in-process probes), less what is booked below;
- `publish`: sending weight versions, seed-ledger entries and probe rounds to a fleet (on the training
  thread: with background uploads only the host copy and the hand-off);
- `wait`: waiting for a fleet's probe rounds (a round collected with a deadline: trainer.zo.rounds.RoundBook under sync and next, pure-ZO steps);
- `eval`: held-out evaluation (in process; on a fleet the hand-off, the results' intake and any fallback);
- `checkpoint`: writing checkpoints;
- `log`: metrics.jsonl, TensorBoard, Prometheus, the progress line, the plot;
- `other` = wall − the sum of the phases above (loop overhead, unbooked work).

A phase opened inside another is booked to itself only: the outer one gets its elapsed time less its nested
phases' (so `step` excludes the `publish` and `wait` of the fleet backend it calls). Only the thread that
created the ledger books time (background uploads run beside the loop and cost it nothing directly). On a
GPU the clock is read after `sync()` (e.g. torch.cuda.synchronize), so asynchronous kernels are booked to the
phase that launched them; `sync` runs only at phase boundaries, where the ledger measures.

The ledger in force is a context variable (`activate`), so code far down the call stack (the fleet backend)
books its phases with the module function `phase(name)` without being handed the ledger; with none active,
`phase` does nothing. Torch-free.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

PHASES = ("startup", "step", "publish", "wait", "eval", "checkpoint", "log", "kd")
_CURRENT: contextvars.ContextVar[TimeLedger | None] = contextvars.ContextVar("sparecycles_ledger", default=None)


class TimeLedger:
    """Wall time of one run (one invocation of `train()`) split into `PHASES` plus `other`.

    Args:
        clock: monotonic seconds (default time.perf_counter).
        sync: called before each clock read at a phase boundary (torch.cuda.synchronize on CUDA; None on CPU).
    Use `start()` then `with ledger.phase(name): ...` on the creating thread, `stop()`, `to_json()`.
    Raises ValueError for an unknown phase name, RuntimeError for phase bookkeeping out of order.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None) -> None:
        self.clock, self.sync = clock, sync
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.counts: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.t0: float | None = None
        self.t1: float | None = None
        self._stack: list[list[Any]] = []  # [name, start, seconds of nested phases]
        self._thread = threading.get_ident()

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    def start(self) -> TimeLedger:
        """Start the wall clock (once). Returns self."""
        if self.t0 is not None:
            raise RuntimeError("the ledger was started already")
        self.t0 = self._now()
        return self

    def stop(self) -> None:
        """Stop the wall clock; phases still open are closed at this instant."""
        if self.t0 is None or self.t1 is not None:
            return
        now = self._now()
        while self._stack:
            self._close(now)
        self.t1 = now

    @property
    def running(self) -> bool:
        return self.t0 is not None and self.t1 is None

    def _close(self, now: float) -> None:
        name, start, nested = self._stack.pop()
        elapsed = now - start
        self.seconds[name] += elapsed - nested
        self.counts[name] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the block's time to `name` (exclusive of phases nested in it). Outside the creating thread, before
        `start` or after `stop`, a no-op."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        if not self.running or threading.get_ident() != self._thread:
            yield
            return
        self._stack.append([name, self._now(), 0.0])
        depth = len(self._stack)
        try:
            yield
        finally:
            if self.running:  # stop() inside the block closed it already
                if len(self._stack) != depth:
                    raise RuntimeError("ledger phases closed out of order")
                self._close(self._now())

    def wall(self) -> float:
        """Seconds from start to stop (to now while running); 0 before start."""
        if self.t0 is None:
            return 0.0
        return (self.t1 if self.t1 is not None else self.clock()) - self.t0

    def to_json(self) -> dict[str, Any]:
        """{"wall_s", "phases_s": {phase: s, ..., "other": s}, "share": {phase: fraction of wall}, "counts"};
        the phases sum to wall_s (other absorbs the rest; it is >= 0 up to clock rounding)."""
        wall = self.wall()
        phases = {k: round(v, 6) for k, v in self.seconds.items()}
        phases["other"] = round(wall - sum(self.seconds.values()), 6)
        share = {k: (round(v / wall, 4) if wall > 0 else 0.0) for k, v in phases.items()}
        return {"wall_s": round(wall, 6), "phases_s": phases, "share": share, "counts": dict(self.counts)}

    @contextlib.contextmanager
    def activate(self) -> Iterator[TimeLedger]:
        """Make this the ledger `phase()` books to (in this context: threads started inside do not inherit it)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


def current() -> TimeLedger | None:
    """The ledger activated in this context, or None."""
    return _CURRENT.get()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """`current().phase(name)`, or a no-op context without an active ledger."""
    led = _CURRENT.get()
    return led.phase(name) if led is not None else contextlib.nullcontext()


def format_ledger(ledger: dict[str, Any], title: str = "time ledger") -> list[str]:
    """Console lines for a `to_json()` dict: one line per phase with seconds and share of the wall time."""
    wall = ledger.get("wall_s", 0.0)
    lines = [f"{title}: wall {wall:.2f} s"]
    for name, secs in ledger.get("phases_s", {}).items():
        share = 100.0 * secs / wall if wall > 0 else 0.0
        lines.append(f"  {name:<10} {secs:9.3f} s {share:5.1f}%")
    return lines
