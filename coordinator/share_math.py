"""Shares of the pool, pure functions (no I/O): which run a worker takes next so that workers' time follows the runs'
shares, work-conserving. coordinator.shares does the Redis side and calls these.

Terms (units: seconds of one worker's wall time, "worker-seconds"):
- a run's share s_r > 0 (wire.bounds.Share, default 1) is its weight; runs with work split the pool's time in
  proportion to their shares;
- its worker-seconds W_r: the summed wall time of its tasks, as workers report them with their results;
- its virtual time v_r = base_r + W_r / s_r: share-normalised worker-seconds. A run created while others run starts at
  base_r = the lowest v among them (`start_base`), so a newcomer neither owes nor is owed the past;
- a worker's target count for run r among the runs with work R: t_r = N * s_r / sum_{q in R} s_q (N workers).

Rule (`choose_run`), for one worker at its heartbeat, given the other workers' current runs: the runs whose worker
count is at least one short of their target come first; when none is, the runs short of their target by a fraction;
among those the run with the lowest virtual time (the most owed), except that the worker stays on its run while that
run's virtual time is within `hysteresis` of the lowest (so a worker does not switch queues at every heartbeat).
Whole workers thus follow the targets at once and a fractional remainder is time-shared by virtual time: over a span
the runs' v stay within `hysteresis` plus one task of each other, so W_a / W_b -> s_a / s_b.
A run with no task waiting is not chosen (work-conserving); with no run waiting, `choose_run` returns None and the
worker consumes every run's queue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RunLoad:
    """One run's state for the rule: share (> 0), worker-seconds W (>= 0), base of its virtual time (seconds),
    whether a task of it waits in its queue, and how many other workers are on it now."""

    share: float
    worker_s: float = 0.0
    base: float = 0.0
    waiting: bool = True
    workers: int = 0

    @property
    def vtime(self) -> float:
        """Virtual time v = base + W / share (share-normalised worker-seconds)."""
        return self.base + self.worker_s / self.share


def targets(shares: Mapping[str, float], n_workers: int) -> dict[str, float]:
    """Each run's target worker count N * s_r / sum(s) (floats summing to `n_workers`); {} for no runs.
    Raises ValueError for a share <= 0 or not finite, or a negative worker count."""
    if n_workers < 0:
        raise ValueError(f"n_workers must be >= 0, got {n_workers}")
    for run, s in shares.items():
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"share of {run} must be finite and > 0, got {s}")
    total = sum(shares.values())
    return {run: n_workers * s / total for run, s in shares.items()}


def start_base(vtimes: Mapping[str, float]) -> float:
    """The virtual-time base of a run created now: the lowest virtual time among the runs there (0 for none)."""
    return min(vtimes.values(), default=0.0)


def choose_run(loads: Mapping[str, RunLoad], current: str | None, n_workers: int, hysteresis: float) -> str | None:
    """The run a worker consumes next (see the module docstring), or None when no run has a task waiting.

    `loads`: every run's state, with `workers` counting the other workers on it (not this one); `current`: the run
    this worker is on (None or a run no longer there: none); `n_workers`: workers in the pool, this one included
    (at least 1 + the others counted); `hysteresis`: seconds of virtual time (>= 0). Ties go to the smaller run id.
    Raises ValueError for a negative hysteresis or a share <= 0.
    """
    if hysteresis < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
    waiting = {run: load for run, load in loads.items() if load.waiting}
    if not waiting:
        return None
    n = max(n_workers, 1 + sum(load.workers for load in waiting.values()))
    goal = targets({run: load.share for run, load in waiting.items()}, n)
    gap = {run: goal[run] - load.workers for run, load in waiting.items()}
    candidates = [run for run in waiting if gap[run] >= 1] or [run for run in waiting if gap[run] > 0]
    best = min(candidates, key=lambda run: (waiting[run].vtime, run))
    if current in candidates and waiting[current].vtime - waiting[best].vtime <= hysteresis:
        return current
    return best


def share_fractions(worker_s: Mapping[str, float]) -> dict[str, float]:
    """Each run's fraction of the summed worker-seconds (all 0 when the sum is 0)."""
    total = sum(worker_s.values())
    return {run: (w / total if total > 0 else 0.0) for run, w in worker_s.items()}
