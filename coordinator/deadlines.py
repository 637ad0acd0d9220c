"""Round deadlines: speculative re-execution of seeds a stopped or slow worker holds.

Celery cannot take a task back from a worker that reserved it and then stopped (SIGSTOP, a hung GPU,
a host paused): the broker redelivers it only after the visibility timeout (an hour by default). So the
coordinator watches each open round's progress (its `done` counter, polled by the reaper loop) and
learns how long the gaps between progress steps usually are. When a round with outstanding seeds has
made no progress for longer than its deadline, while the run's queue is empty (every task was taken:
the remaining ones sit with a worker) and some active worker reports itself idle (heartbeat `busy`
false), its outstanding seeds are published again. An idle worker takes
them; the first result wins, because intake already drops a second result of a seed as a duplicate.

deadline = max(`speculate_min_s`, `speculate_factor` x quantile `speculate_quantile` of the last 256
progress gaps of the run), or `speculate_initial_s` before any gap was seen. A round is re-issued at most
`speculate_max` times; a spot-check copy whose first replica the only live worker holds is given up instead
(`drop_spot_copy`). A worker that is lost (lease expired) makes the rounds re-issue at the next tick
without waiting for the deadline. Re-issues are counted in `sparecycles_tasks_redispatched_total{reason=
"deadline"}`; outstanding seeds per run are the gauge `sparecycles_outstanding_seeds`.

The progress history is per process; the re-issue count is in Redis (`INCR`), so several coordinator
processes re-issue a round at most `speculate_max` times together.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from coordinator.store import Store
from wire.round_messages import ProbeRound

GAP_WINDOW = 256


def quantile(values: list[float], q: float) -> float:
    """The `q`-quantile (0 <= q <= 1) of `values` by linear interpolation between order statistics
    (numpy's default "linear" method). Raises ValueError for an empty list."""
    if not values:
        raise ValueError("quantile of no values")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RoundWatch:
    """Per-process watcher of open rounds; `tick(now)` is called by the coordinator's reaper loop."""

    def __init__(self, store: Store, drop_spot_copy: Callable[[ProbeRound, int], None] | None = None) -> None:
        """`drop_spot_copy(round, seed)` gives up a spot-check copy no live worker could take
        (coordinator.intake.Intake.drop_spot_copy); None re-issues every outstanding copy."""
        self.store = store
        self.drop_spot_copy = drop_spot_copy
        self.s = store.settings
        self._last: dict[tuple[str, str], tuple[int, float]] = {}  # (run, round) -> (done, time it changed)
        self._gaps: dict[str, collections.deque[float]] = {}
        self._lost_since_tick = False

    def worker_lost(self) -> None:
        """A lease expired: the next tick at which a worker can take copies (the run's queue empty, a worker idle)
        re-issues the outstanding seeds of every open round without waiting for its deadline."""
        self._lost_since_tick = True

    def deadline(self, run: str) -> float:
        """Seconds without progress after which a round of `run` is re-issued."""
        gaps = self._gaps.get(run)
        if not gaps:
            return self.s.speculate_initial_s
        return max(
            self.s.speculate_min_s, self.s.speculate_factor * quantile(list(gaps), self.s.speculate_quantile)
        )

    def tick(self, now: float | None = None) -> list[tuple[str, str, int]]:
        """Observe every open round once; re-issue the quiet ones. Returns (run, round, tasks re-issued)."""
        now = time.time() if now is None else now
        st, lost, self._lost_since_tick = self.store, self._lost_since_tick, False
        reissued = []
        alive = set()
        held_back = False  # a lost worker's round that no idle worker could take yet
        for run in st.r.smembers(st.keys.k_runs):
            rids = sorted(st.r.smembers(st.keys.k_run(run, "rounds:open")))
            if not rids:
                continue
            pipe = st.r.pipeline(transaction=False)
            for rid in rids:
                pipe.hmget(st.keys.k_round(run, rid), ["done", "n_seeds", "created_at", "state"])
            can_reissue = None
            for rid, (done, n_seeds, created, state) in zip(rids, pipe.execute()):
                if done is None or state != "open":
                    continue
                key, done = (run, rid), int(done)
                alive.add(key)
                prev = self._last.get(key)
                if prev is None:
                    prev = self._last[key] = (done, max(float(created), now - self.s.speculate_initial_s))
                if done != prev[0]:
                    self._gaps.setdefault(run, collections.deque(maxlen=GAP_WINDOW)).append(now - prev[1])
                    self._last[key] = prev = (done, now)
                if done >= int(n_seeds) or (not lost and now - prev[1] <= self.deadline(run)):
                    continue
                if can_reissue is None:
                    can_reissue = st.dispatch.broker_queue_length(run) == 0 and st.workers.idle_workers() > 0
                if can_reissue:
                    n = self._reissue(run, rid)
                    if n:
                        reissued.append((run, rid, n))
                        self._last[key] = (done, now)  # the next deadline counts from this re-issue
                else:
                    held_back = True
        for key in set(self._last) - alive:
            del self._last[key]
        # A lapsed lease is acted on once a worker can take the copies (the queue drained, a worker idle), not only
        # at the tick that saw it: otherwise the lost worker's seeds wait for the round's deadline or the broker's
        # visibility timeout, whichever comes first.
        self._lost_since_tick = self._lost_since_tick or (lost and held_back)
        return reissued

    def _reissue(self, run: str, rid: str) -> int:
        st = self.store
        if st.r.incr(st.keys.k_round(run, rid, "speculated")) > self.s.speculate_max:
            return 0
        st.r.expire(st.keys.k_round(run, rid, "speculated"), 7 * 86400)
        rnd: ProbeRound = st.rounds.get_round(run, rid)
        pending = st.dispatch.outstanding(run, rid)
        if self.drop_spot_copy is not None and pending.get(1):
            # a second replica whose first is held by the only live worker would come back refused (`same_worker`)
            keep = [s for s in pending[1] if st.spot_copy_placeable(run, rid, s)]
            for seed in set(pending[1]) - set(keep):
                self.drop_spot_copy(rnd, seed)
            pending[1] = keep
        tasks = []
        for replica, seeds in pending.items():
            if seeds:
                tasks += st.dispatch.tasks_for(rnd, seeds, replica)
        if tasks:
            st.dispatch.publish_tasks(run, tasks)
        return len(tasks)
