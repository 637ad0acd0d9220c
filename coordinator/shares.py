"""Shares of the pool on Redis (a part of `coordinator.store.Store`): each run's share and worker-seconds, and the run
each worker is told to consume at its heartbeat (the rule itself: coordinator.share_math.choose_run).

Keys: the run hash `{p}:{run}:run` gains `share` (its RunSpec's), `vt_base` (the virtual-time base given at creation)
and `worker_s` (the summed `task_s` of its results, seconds); `{p}:share_assign` (hash worker id -> "run<TAB>unix
time", "" for "every queue") records each worker's last answer. An entry older than one lease is not counted: a worker
that stopped heartbeating frees its place within one lease, and a run that ended (its queue off `RunStore.queues`) is
no longer chosen at the next heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from coordinator.keys import Keys
from coordinator.runs import RunStore
from coordinator.share_math import RunLoad, choose_run, start_base

# Adds a task's seconds to a run that exists (never creates the hash of an unknown run); returns the new total.
ADD_TIME = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('HINCRBYFLOAT', KEYS[1], 'worker_s', ARGV[1])
"""


class ShareBook:
    """Runs' shares and worker-seconds, and the share-following queue answer of each heartbeat.

    `queue_depths()` is the dispatch's (run -> tasks waiting in its queue); `lease_s` the workers' lease (seconds);
    `hysteresis_s` the virtual-time margin of `share_math.choose_run`.
    """

    def __init__(self, r: redis.Redis, keys: Keys, runs: RunStore, queue_depths: Callable[[], dict[str, int]],
                 lease_s: float, hysteresis_s: float) -> None:
        self.r, self.keys, self.runs, self._depths = r, keys, runs, queue_depths
        self.lease_s, self.hysteresis_s = lease_s, hysteresis_s

    def start_run(self, run: str, share: float) -> None:
        """Record a new run's share and its virtual-time base: the lowest virtual time among the other runs."""
        others = {r: load.vtime for r, load in self._loads().items() if r != run}
        self.r.hset(self.keys.k_run(run, "run"), mapping={"share": share, "vt_base": start_base(others)})

    def add_time(self, run: str, seconds: float) -> float | None:
        """Add one task's `seconds` to `run`'s worker-seconds; the new total, or None for an unknown run."""
        total = self.r.eval(ADD_TIME, 1, self.keys.k_run(run, "run"), repr(float(seconds)))
        return None if total is None else float(total)

    async def add_time_async(self, aredis: object, run: str, seconds: float) -> float | None:
        """`add_time` on the API's asyncio Redis client `aredis` (the results route)."""
        total = await aredis.eval(ADD_TIME, 1, self.keys.k_run(run, "run"), repr(float(seconds)))
        return None if total is None else float(total)

    def _loads(self, depths: dict[str, int] | None = None) -> dict[str, RunLoad]:
        """Every listed run's share, worker-seconds, base and (with `depths`) whether a task waits."""
        runs = sorted(self.r.smembers(self.keys.k_runs))
        pipe = self.r.pipeline(transaction=False)
        for run in runs:
            pipe.hmget(self.keys.k_run(run, "run"), ["share", "worker_s", "vt_base"])
        out = {}
        for run, (share, worker_s, base) in zip(runs, pipe.execute()):
            out[run] = RunLoad(share=float(share or 1.0), worker_s=float(worker_s or 0.0), base=float(base or 0.0),
                               waiting=depths is None or depths.get(run, 0) > 0)
        return out

    def run_shares(self) -> dict[str, float]:
        """run -> share of every listed run (the scrape-time gauge `sparecycles_run_share`)."""
        return {run: load.share for run, load in self._loads().items()}

    def worker_seconds(self) -> dict[str, float]:
        """run -> worker-seconds of every listed run (summed `task_s`)."""
        return {run: load.worker_s for run, load in self._loads().items()}

    def workers_on(self, run: str, now: float | None = None) -> set[str] | None:
        """Workers told within one lease to consume `run`'s queue (its own, or every queue); None when no worker was
        told anything within a lease (no heartbeat since: the caller knows nothing from shares)."""
        now = time.time() if now is None else now
        fresh = {wid: entry.partition("\t") for wid, entry in self.r.hgetall(self.keys.k_share_assign).items()}
        fresh = {wid: r for wid, (r, _, at) in fresh.items() if float(at or 0) >= now - self.lease_s}
        return None if not fresh else {wid for wid, r in fresh.items() if r in (run, "")}

    def queues_for(self, wid: str, now: float | None = None, active: bool = True) -> list[str]:
        """The probe queues worker `wid` is told to consume now: its chosen run's queue, or every run's queue when
        no run has a task waiting (work-conserving). Records the answer in `k_share_assign`. A worker not `active`
        (draining, quarantined, or yielding to its serving engine: it takes no task) is told every queue and counted
        on no run."""
        now = time.time() if now is None else now
        if not active:
            self.r.hdel(self.keys.k_share_assign, wid)
            return self.runs.queues()
        loads = self._loads(self._depths())
        if not loads:
            self.r.hset(self.keys.k_share_assign, wid, f"\t{now}")
            return []
        current, others, stale = None, {}, []
        for other, entry in self.r.hgetall(self.keys.k_share_assign).items():
            run, _, at = entry.partition("\t")
            if other == wid:
                current = run or None
            elif float(at or 0) < now - self.lease_s:
                stale.append(other)
            else:
                others[other] = run
        counts = {run: sum(1 for r in others.values() if r == run) for run in loads}
        loads = {run: RunLoad(load.share, load.worker_s, load.base, load.waiting, counts[run])
                 for run, load in loads.items()}
        chosen = choose_run(loads, current, 1 + len(others), self.hysteresis_s)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.k_share_assign, wid, f"{chosen or ''}\t{now}")
        if stale:
            pipe.hdel(self.keys.k_share_assign, *stale)
        pipe.execute()
        return [self.keys.queue_for(chosen)] if chosen else [self.keys.queue_for(run) for run in sorted(loads)]
