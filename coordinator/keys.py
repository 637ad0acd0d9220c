"""Redis key layout of the coordinator's state (one place, so every module and script agrees).

Run keys are `{prefix}:{run}:...` with the run in braces (a Redis Cluster hash tag, so the multi-key
intake script touches one slot); worker keys are `{prefix}:w:{id}`; global sets `{prefix}:runs`,
`{prefix}:workers`, `{prefix}:leases`. Celery queues are `{queue_prefix}.{run}`.
"""

from __future__ import annotations

import functools


@functools.cache
def redis_client_kwargs() -> dict:
    """Extra keyword arguments for every Redis client of the coordinator (sync and asyncio).

    redis-py >= 7 builds a `DriverInfo` per new connection, which reads the installed package metadata
    (importlib.metadata, ~3 ms of CPU). A burst of new pooled connections then stalls the event loop for
    hundreds of ms; one `DriverInfo` per process, passed to every client, removes that cost.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # older redis-py: no per-connection metadata lookup
        return {}
    return {"driver_info": DriverInfo()}


def results_stream_key(prefix: str, run: str) -> str:
    """Redis Stream of a run's accepted-result events (each entry has field `e`: a StreamEvent JSON)."""
    return f"{prefix}:{{{run}}}:results"


class Keys:
    """Key names under `prefix` (state) and `queue_prefix` (Celery queues)."""

    def __init__(self, prefix: str, queue_prefix: str) -> None:
        self.p = prefix
        self.queue_prefix = queue_prefix

    def k_worker(self, wid: str) -> str:
        """Hash of one worker's record."""
        return f"{self.p}:w:{wid}"

    def k_run(self, run: str, *parts: str) -> str:
        """A key of run `run` (hash-tagged by the run)."""
        return ":".join([f"{self.p}:{{{run}}}", *parts])

    def k_round(self, run: str, rid: str, *parts: str) -> str:
        """A key of round `rid` of run `run`."""
        return self.k_run(run, "rd", rid, *parts)

    def queue_for(self, run: str) -> str:
        """Celery queue of a run's probe tasks."""
        return f"{self.queue_prefix}.{run}"

    @property
    def k_runs(self) -> str:
        """Set of run ids."""
        return f"{self.p}:runs"

    @property
    def k_workers(self) -> str:
        """Set of registered worker ids."""
        return f"{self.p}:workers"

    @property
    def k_share_assign(self) -> str:
        """Hash worker id -> "run<TAB>unix time": the run each worker was last told to consume (coordinator.shares)."""
        return f"{self.p}:share_assign"

    @property
    def k_leases(self) -> str:
        """Sorted set worker id -> lease expiry (unix seconds)."""
        return f"{self.p}:leases"

    def k_enrolled(self, token_id: str) -> str:
        """Set of the workers enrolled with the enrollment token `token_id` (sha256 prefix)."""
        return f"{self.p}:enrolled:{token_id}"

    @property
    def k_broker_queues(self) -> str:
        """Hash queue -> "rw" (granted to the workers' broker users) or "w" (its run ended: write only)."""
        return f"{self.p}:broker_queues"

    @property
    def k_broker_ended(self) -> str:
        """Hash queue -> when its run ended (unix seconds), for the queues marked "w" in `k_broker_queues`: the
        reaper retires each mark a window after this (coordinator.registry `retire_ended_queues`)."""
        return f"{self.p}:broker_queues_ended"

    @property
    def k_broker_acl_lock(self) -> str:
        """The lock every change of the workers' broker users' key rules holds (coordinator.registry)."""
        return f"{self.p}:broker_acl_lock"

    @property
    def k_expiry(self) -> str:
        """Sorted set of lost workers -> unix time at which the reaper deletes them."""
        return f"{self.p}:expiry"
