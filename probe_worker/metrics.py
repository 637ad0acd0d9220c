"""Prometheus metrics of one probe worker (names start with `sparecycles_worker_`).

Counters end in `_total`; labels carry only small closed sets (never per-seed or per-task values).
Served on an optional port by `serve_metrics` (the worker CLI's `--metrics-port`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# (attribute, metric type, name after "sparecycles_worker_", help, labels): one row per metric. A Histogram's
# buckets are _BUCKETS_S.
METRICS: tuple[tuple[str, type, str, str, tuple[str, ...]], ...] = (
    ("probes", Counter, "probes_evaluated_total", "Probe seeds evaluated (one L+ and one L- each)", ()),
    ("clean", Counter, "clean_evaluations_total", "Clean-loss L0 evaluations (one per round)", ()),
    ("tasks", Counter, "tasks_total", "Probe tasks handled, by outcome", ("outcome",)),
    ("results", Counter, "results_total", "Results posted, by coordinator intake outcome", ("outcome",)),
    ("eval_seconds", Histogram, "evaluation_seconds", "Wall time of one loss evaluation (forward pass)", ()),
    ("weight_load_seconds", Histogram, "weight_load_seconds",
     "Wall time to make a version ready (fetch, verify, load)", ()),
    ("weight_bytes", Counter, "weight_bytes_total", "Shard bytes downloaded from the blob store", ()),
    ("cache_hits", Counter, "cache_hits_total", "Cache hits, by kind (shard, shared: a shard read from the "
     "coordinator's blob directory, version, batch, clean)", ("kind",)),
    ("cache_misses", Counter, "cache_misses_total", "Cache misses, by kind (shard, version, batch, clean)", ("kind",)),
    ("corrupt", Counter, "corrupt_blobs_total", "Downloaded or cached blobs whose sha256 did not match", ()),
    ("replayed", Counter, "ledger_entries_replayed_total", "Pure-ZO seed-ledger entries replayed onto weights", ()),
    ("version", Gauge, "current_version", "Weight version most recently made ready (-1 before any)", ()),
    ("reenrollments", Counter, "reenrollments_total", "Times the worker joined again (new id) after the "
     "coordinator forgot it (its store lost its state, or an admin deleted it)", ()),
    ("rejected_messages", Counter, "rejected_messages_total", "Broker queue items dropped before Celery saw them, "
     "by reason (undecodable: not UTF-8 JSON; not_envelope: JSON that is not a kombu message)", ("reason",)),
    ("draining", Gauge, "draining", "1 while the worker is draining (not taking tasks)", ()),
    ("not_taking", Gauge, "not_taking_tasks", "1 while this reason keeps the worker from taking tasks (operator_drain, "
     "coordinator_drain, gpu_busy, engine_busy, shutting_down)", ("reason",)),
    # Beside a serving engine (probe_worker.serving; `--serving-metrics`)
    ("serving_load", Gauge, "serving_engine_load", "The co-located engine's requests running + waiting at the last "
     "readable scrape", ()),
    ("serving_yielded", Counter, "serving_yielded_seconds_total", "Seconds the worker yielded to the serving "
     "engine", ()),
    ("serving_idle", Counter, "serving_engine_idle_seconds_total", "Seconds the serving engine was seen idle", ()),
    ("serving_used", Counter, "serving_idle_used_seconds_total", "Seconds of the engine's idle time the worker "
     "spent in tasks", ()),
    ("serving_reclaim", Histogram, "serving_reclaim_seconds", "A request's arrival (the last idle scrape before "
     "it) to the end of the worker's task then running (0 when none ran)", ()),
    ("serving_errors", Counter, "serving_scrape_errors_total", "Serving-engine metrics scrapes that gave no load, "
     "by reason (unreachable, http, parse, no_gauge, non_finite); the worker yields on each", ("reason",)),
)


class WorkerMetrics:
    """The worker's metric set (one attribute per row of METRICS), registered on `registry` (the process-global
    default unless given).

    Units: `*_seconds` are seconds, `*_bytes` are bytes.
    """

    probes: Counter
    clean: Counter
    tasks: Counter
    results: Counter
    eval_seconds: Histogram
    weight_load_seconds: Histogram
    weight_bytes: Counter
    cache_hits: Counter
    cache_misses: Counter
    corrupt: Counter
    replayed: Counter
    version: Gauge
    reenrollments: Counter
    rejected_messages: Counter
    draining: Gauge
    not_taking: Gauge
    serving_load: Gauge
    serving_yielded: Counter
    serving_idle: Counter
    serving_used: Counter
    serving_reclaim: Histogram
    serving_errors: Counter

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        for attr, kind, name, doc, labels in METRICS:
            extra: dict[str, Any] = {"buckets": _BUCKETS_S} if kind is Histogram else {}
            setattr(self, attr, kind(f"sparecycles_worker_{name}", doc, list(labels), registry=registry, **extra))
        self.version.set(-1)


_DEFAULT: WorkerMetrics | None = None


def default_metrics() -> WorkerMetrics:
    """The process-wide WorkerMetrics on the default registry (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = WorkerMetrics()
    return _DEFAULT


def serve_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the default registry at http://addr:port/metrics from a daemon thread.

    Raises ValueError for a port outside 1..65535; OSError if the port is taken.
    """
    if not 0 < port < 65536:
        raise ValueError(f"metrics port must be in 1..65535, got {port}")
    start_http_server(port, addr=addr)
