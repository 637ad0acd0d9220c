"""Prometheus metrics of one probe worker (names start with `sparecycles_worker_`).

Counters end in `_total`; labels carry only small closed sets (never per-seed or per-task values).
Served on an optional port by `serve_metrics` (the worker CLI's `--metrics-port`).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class WorkerMetrics:
    """The worker's metric set, registered on `registry` (the process-global default unless given).

    Units: `*_seconds` are seconds, `*_bytes` are bytes.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.probes = Counter(
            "sparecycles_worker_probes_evaluated_total", "Probe seeds evaluated (one L+ and one L- each)",
            registry=registry,
        )
        self.clean = Counter(
            "sparecycles_worker_clean_evaluations_total", "Clean-loss L0 evaluations (one per round)",
            registry=registry,
        )
        self.tasks = Counter(
            "sparecycles_worker_tasks_total", "Probe tasks handled, by outcome", ["outcome"], registry=registry
        )
        self.results = Counter(
            "sparecycles_worker_results_total", "Results posted, by coordinator intake outcome", ["outcome"],
            registry=registry,
        )
        self.eval_seconds = Histogram(
            "sparecycles_worker_evaluation_seconds", "Wall time of one loss evaluation (forward pass)",
            buckets=_BUCKETS_S, registry=registry,
        )
        self.weight_load_seconds = Histogram(
            "sparecycles_worker_weight_load_seconds", "Wall time to make a version ready (fetch, verify, load)",
            buckets=_BUCKETS_S, registry=registry,
        )
        self.weight_bytes = Counter(
            "sparecycles_worker_weight_bytes_total", "Shard bytes downloaded from the blob store",
            registry=registry,
        )
        self.cache_hits = Counter(
            "sparecycles_worker_cache_hits_total", "Cache hits, by kind (shard, shared: a shard read from the coordinator's blob directory, version, batch, clean)",
            ["kind"], registry=registry,
        )
        self.cache_misses = Counter(
            "sparecycles_worker_cache_misses_total", "Cache misses, by kind (shard, version, batch, clean)",
            ["kind"], registry=registry,
        )
        self.corrupt = Counter(
            "sparecycles_worker_corrupt_blobs_total", "Downloaded or cached blobs whose sha256 did not match",
            registry=registry,
        )
        self.replayed = Counter(
            "sparecycles_worker_ledger_entries_replayed_total", "Pure-ZO seed-ledger entries replayed onto weights",
            registry=registry,
        )
        self.version = Gauge(
            "sparecycles_worker_current_version", "Weight version most recently made ready (-1 before any)",
            registry=registry,
        )
        self.version.set(-1)
        self.reenrollments = Counter(
            "sparecycles_worker_reenrollments_total", "Times the worker joined again (new id) after the coordinator "
            "forgot it (its store lost its state, or an admin deleted it)", registry=registry,
        )
        self.rejected_messages = Counter(
            "sparecycles_worker_rejected_messages_total", "Broker queue items dropped before Celery saw them, by "
            "reason (undecodable: not UTF-8 JSON; not_envelope: JSON that is not a kombu message)", ["reason"],
            registry=registry,
        )
        self.draining = Gauge(
            "sparecycles_worker_draining", "1 while the worker is draining (not taking tasks)", registry=registry
        )
        # Beside a serving engine (probe_worker.serving; `--serving-metrics`)
        self.serving_load = Gauge(
            "sparecycles_worker_serving_engine_load", "The co-located engine's requests running + waiting at the "
            "last readable scrape", registry=registry,
        )
        self.serving_yielded = Counter(
            "sparecycles_worker_serving_yielded_seconds_total", "Seconds the worker yielded to the serving engine",
            registry=registry,
        )
        self.serving_idle = Counter(
            "sparecycles_worker_serving_engine_idle_seconds_total", "Seconds the serving engine was seen idle",
            registry=registry,
        )
        self.serving_used = Counter(
            "sparecycles_worker_serving_idle_used_seconds_total", "Seconds of the engine's idle time the worker "
            "spent in tasks", registry=registry,
        )
        self.serving_reclaim = Histogram(
            "sparecycles_worker_serving_reclaim_seconds", "A request's arrival (the last idle scrape before it) to "
            "the end of the worker's task then running (0 when none ran)", buckets=_BUCKETS_S, registry=registry,
        )
        self.serving_errors = Counter(
            "sparecycles_worker_serving_scrape_errors_total", "Serving-engine metrics scrapes that gave no load, by "
            "reason (unreachable, http, parse, no_gauge, non_finite); the worker yields on each", ["reason"],
            registry=registry,
        )


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
