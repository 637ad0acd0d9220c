"""Prometheus metric definitions of the coordinator (prometheus-client).

Names start with `sparecycles_`; counters end in `_total` (prometheus-client appends it); labels are
bounded enums (outcome, reason, state, run) — never per seed or per task. Each `CoordinatorMetrics`
owns its registry so several apps in one process (tests) do not collide.

Several coordinator processes (`sparecycles coordinator --workers N`) use prometheus-client's
multiprocess mode: with `PROMETHEUS_MULTIPROC_DIR` set before prometheus-client is imported, every
counter and histogram lives in a per-process file there, and `exposition()` sums them over all
processes. The two gauges (workers by state, queue depth) are not per-process values at all: they are
read from Redis at scrape time, so they are added once to the summed output and need no
`multiprocess_mode`. Any per-process `Gauge` added later must declare one (e.g. "livesum").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from wire.round_messages import INTAKE_OUTCOMES

SPOT_OUTCOMES = ("agree", "disagree", "resolved", "unresolved", "skipped")


@dataclass(eq=False)  # registered by identity: hashable as any object
class _LiveGauges(Collector):
    """Gauges read from Redis at scrape time: workers by state, Celery queue depth, outstanding seeds and share
    per run, and whether Redis could be read at all (`sparecycles_state_store_up`)."""

    _workers: Callable[[], dict[str, int]]
    _queues: Callable[[], dict[str, int]]
    _outstanding: Callable[[], dict[str, int]] | None = None
    _shares: Callable[[], dict[str, float]] | None = None

    def _families(self) -> list[tuple[GaugeMetricFamily, Callable[[], dict[str, int]] | None]]:
        fams = [
            (
                GaugeMetricFamily("sparecycles_workers", "Registered workers by state.", labels=["state"]),
                self._workers,
            ),
            (
                GaugeMetricFamily(
                    "sparecycles_queue_depth", "Probe tasks waiting in a run's queue.", labels=["run"]
                ),
                self._queues,
            ),
        ]
        if self._outstanding is not None:
            help_ = "Seeds of open rounds without a delivered value (queued, being evaluated, or stuck)."
            fams.append(
                (GaugeMetricFamily("sparecycles_outstanding_seeds", help_, labels=["run"]), self._outstanding)
            )
        if self._shares is not None:
            help_ = "A run's share of the pool (its RunSpec's `share`; workers' time follows the shares), by run."
            fams.append((GaugeMetricFamily("sparecycles_run_share", help_, labels=["run"]), self._shares))
        up = GaugeMetricFamily("sparecycles_state_store_up", "1 if the last scrape could read Redis, else 0.")
        return [*fams, (up, None)]

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only: registering the collector must not read Redis (it may be down at start).
        for fam, _ in self._families():
            yield fam

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # While Redis is unreachable the Redis-backed gauges are left out and the state-store gauge reads
        # 0: /metrics keeps serving every counter and the process metrics.
        fams = self._families()
        up = 1
        for fam, read in fams[:-1]:
            try:
                values = read()
            except (redis.RedisError, OSError):
                up = 0
                break
            for label, n in sorted(values.items()):
                fam.add_metric([label], n)
            yield fam
        fams[-1][0].add_metric([], up)
        yield fams[-1][0]


class CoordinatorMetrics:
    """All coordinator metrics on one registry. Histogram units: versions, seconds."""

    def _add_intake_metrics(self, r: CollectorRegistry) -> None:
        """Intake, dispatch, round, blob and HTTP-refusal metrics on registry `r`."""
        self.results = Counter(
            "sparecycles_intake_results",
            "Probe results received, by intake outcome.",
            ["outcome"],
            registry=r,
        )
        for outcome in INTAKE_OUTCOMES:
            self.results.labels(outcome)
        self.tasks_published = Counter(
            "sparecycles_tasks_published", "Probe tasks sent to Celery.", registry=r
        )
        self.redispatched = Counter(
            "sparecycles_tasks_redispatched",
            "Probe tasks re-sent by intake, by reason.",
            ["reason"],
            registry=r,
        )
        self.rounds_opened = Counter("sparecycles_rounds_opened", "Probe rounds opened.", registry=r)
        self.result_age = Histogram(
            "sparecycles_result_age_versions",
            "Accepted results: latest version minus the round's version.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.round_latency = Histogram(
            "sparecycles_round_latency_seconds",
            "Round opened to every seed accepted.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
            registry=r,
        )
        self.blob_bytes_served = Counter("sparecycles_blob_bytes_served", "Blob bytes sent.", registry=r)
        self.blob_bytes_stored = Counter("sparecycles_blob_bytes_stored", "Blob bytes uploaded.", registry=r)
        self.rejected_requests = Counter(
            "sparecycles_rejected_requests", "HTTP requests refused, by reason.", ["reason"], registry=r
        )

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._live: _LiveGauges | None = None
        r = self.registry
        self._add_intake_metrics(r)
        self.spot_checks = Counter(
            "sparecycles_spot_checks", "Spot-check decisions, by outcome.", ["outcome"], registry=r
        )
        for outcome in SPOT_OUTCOMES:
            self.spot_checks.labels(outcome)
        self.spot_copies_dropped = Counter(
            "sparecycles_spot_copies_dropped",
            "Spot-check copies not evaluated for want of a second worker, by reason: one_worker_at_open (a round "
            "opened with one live worker has no spot checks), no_other_worker (only the workers that evaluated the "
            "seed's other replicas were live: the copy was given up, not re-sent).",
            ["reason"],
            registry=r,
        )
        for reason in ("one_worker_at_open", "no_other_worker"):
            self.spot_copies_dropped.labels(reason)
        self.quarantined = Counter("sparecycles_workers_quarantined", "Workers quarantined.", registry=r)
        self.lost = Counter("sparecycles_workers_lost", "Worker leases that expired.", registry=r)
        self.broker_revoked = Counter(
            "sparecycles_broker_grants_revoked",
            "Workers' broker users whose grant on an ended run's queue was withdrawn (taking refused).",
            registry=r,
        )
        self.broker_retired = Counter(
            "sparecycles_broker_queues_retired",
            "Ended runs' queues whose write-only rule was dropped from every worker's broker user, and whose "
            "leftovers were deleted, a retirement window after the end (SPARECYCLES_ENDED_QUEUE_RETIRE_TIMEOUTS).",
            registry=r,
        )
        if multiprocess_dir() is None:  # per-process figures; in multiprocess mode they would not add up
            ProcessCollector(registry=r)
        self.run_worker_seconds = Counter(
            "sparecycles_run_worker_seconds",
            "Workers' wall time spent on a run's tasks (seconds, as each task's results report it), by run.",
            ["run"],
            registry=r,
        )
        self.retracted = Counter(
            "sparecycles_results_retracted", "Accepted results retracted after quarantine.", registry=r
        )

    def attach_live(
        self,
        workers: Callable[[], dict[str, int]],
        queues: Callable[[], dict[str, int]],
        outstanding: Callable[[], dict[str, int]] | None = None,
        shares: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Register the scrape-time gauges (worker states, queue depths, outstanding seeds and share per run)."""
        self._live = _LiveGauges(workers, queues, outstanding, shares)
        self.registry.register(self._live)

    def exposition(self) -> bytes:
        """The text exposition for `/metrics`: this registry, or in multiprocess mode the sum over every
        coordinator process's counters and histograms plus the live gauges (read once)."""
        path = multiprocess_dir()
        if path is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path)
        if self._live is not None:
            merged.register(self._live)
        return generate_latest(merged)


def multiprocess_dir() -> str | None:
    """`PROMETHEUS_MULTIPROC_DIR` if set (prometheus-client then keeps metric values in files there)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
