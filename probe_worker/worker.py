"""A probe worker process: register over REST, heartbeat, run an in-process Celery worker, drain on request.

Lifecycle: `POST /v1/workers` with the enrollment token returns the broker URL, the run queues and
timings; the Celery app is built from those (`coordinator.celery_app.make_celery`: JSON only, late
acks, reject on worker lost, prefetch 1, visibility timeout from the coordinator, soft shutdown) and
started with `--pool=solo` (one process per device: CUDA does not survive fork).

A control thread heartbeats every `control_interval_s` and reconciles the consumed queues with what
the worker should consume: the coordinator's queue list, or nothing while draining (coordinator state
'draining'/'quarantined', SIGUSR1 until SIGUSR2, or, optionally, while other processes keep the GPU busy). Queues are added and cancelled
through Celery's remote control addressed to this worker only; a task delivered before a cancel
takes effect is handed back (rejected with requeue) unevaluated, and the in-flight task always
finishes. SIGTERM is Celery's warm shutdown within `soft_shutdown_s`; the worker then deregisters.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from celery.signals import worker_ready

from coordinator.celery_app import PROBE_TASK_NAME, make_celery
from coordinator.client import CoordinatorClient, CoordinatorHTTPError
from coordinator.messages import Heartbeat, WorkerRegistration
from probe_worker.cache import WeightCache
from probe_worker.metrics import default_metrics, serve_metrics
from probe_worker.runtime import ProbeRuntime
from probe_worker.tasks import BusyPolicy, DrainState, gpu_utilization_reader, register_probe_task

LONG_POLL_S = 2.0  # a prefetch long poll's wait (short: a stopping coordinator waits for pending ones)
log = logging.getLogger("sparecycles.worker")
IDLE_QUEUE = "sparecycles.idle"  # consumed only while no run queue exists (Celery needs at least one)


def warm_up() -> None:
    """Import the evaluation stack (torch, transformers' model base, kernels, the loss) before consuming.

    On a busy host these imports take seconds; paying them before the first task keeps that task well
    inside the visibility timeout (otherwise the broker would redeliver it to another worker).
    """
    import transformers.modeling_utils  # noqa: F401

    import kernels  # noqa: F401
    from fleet.batch_wire import loss_for_kind

    loss_for_kind("lm"), loss_for_kind("classifier")  # both probe losses' modules


@dataclass(frozen=True)
class WorkerOptions:
    """Settings of one worker process. Durations in seconds.

    coordinator: base URL; token: enrollment token; device: "cpu" or "cuda:N"; name: shown in
    `GET /v1/workers`; metrics_port: serve Prometheus metrics there (None: off); cache_dir: weight cache
    root (None: trainer.paths.cache_dir()/worker); shared_blob_dir: the coordinator's blob directory when the
    worker shares its file system (shards read in place, WeightCache); keep_versions: models kept loaded;
    control_interval_s: heartbeat and drain-check period (<= 1 s drains within a second);
    soft_shutdown_s: how long SIGTERM waits for the in-flight task; prefetch_interval_s: how often the
    latest version of each consumed run is checked and loaded ahead of its rounds (0: load lazily);
    yield_gpu_util_pct: drain while the GPU is this busy (percent) with other work (BusyPolicy, NVML;
    None: off); probe_path: the probe evaluator (kernels.fastpath.make_evaluator: "auto", "whole" or
    "per_unit"); loglevel: Celery's; metrics_host: the interface the metrics port binds.
    """

    coordinator: str
    token: str
    device: str = "cpu"
    name: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    cache_dir: Path | None = None
    shared_blob_dir: Path | None = None
    keep_versions: int = 2
    control_interval_s: float = 0.5
    soft_shutdown_s: float = 30.0
    prefetch_interval_s: float = 1.0
    yield_gpu_util_pct: float | None = None
    probe_path: str = "auto"
    loglevel: str = "INFO"


class ProbeWorker:
    """One registered worker. `run()` blocks until Celery shuts down (SIGTERM/SIGINT), then deregisters.

    Raises CoordinatorHTTPError/httpx errors if registration fails, ValueError for bad options or a
    coordinator that names a different probe task.
    """

    def __init__(self, opts: WorkerOptions) -> None:
        if opts.control_interval_s <= 0 or opts.soft_shutdown_s < 0:
            raise ValueError("control_interval_s must be > 0 and soft_shutdown_s >= 0")
        self.opts = opts
        self.host = socket.gethostname()[:64] or "unknown"
        self.name = opts.name or f"{self.host}-{opts.device}"
        self.metrics = default_metrics()
        self.client = CoordinatorClient(opts.coordinator)
        self.reg = self.client.register(
            WorkerRegistration(name=self.name[:128], device=opts.device, host=self.host), opts.token
        )
        if self.reg.probe_task_name != PROBE_TASK_NAME:
            raise ValueError(f"coordinator sends task {self.reg.probe_task_name!r}; this worker runs "
                             f"{PROBE_TASK_NAME!r}; upgrade the worker")
        self.worker_id = self.reg.worker_id
        # Heartbeats get their own short-timeout, single-try client: a hung coordinator must not stall the
        # control loop (and with it local drains) behind the task path's long retries.
        self.hb_client = CoordinatorClient(opts.coordinator, self.client.token, attempts=1,
                                           timeout_s=max(1.0, min(5.0, self.reg.lease_seconds / 3)))
        self.hostname = f"{self.worker_id}@{self.host}"
        self.app = make_celery(self.reg.broker_url, visibility_timeout_s=self.reg.visibility_timeout_s,
                               soft_shutdown_s=opts.soft_shutdown_s)
        # kombu sweeps for expired unacked messages only every interval * throttle seconds (100 s by
        # default); sweep at a fifth of the visibility timeout so a killed worker's task returns promptly.
        transport = dict(self.app.conf.broker_transport_options or {})
        transport["unacked_restore_interval"] = max(1.0, min(10.0, self.reg.visibility_timeout_s / 5))
        transport["unacked_restore_throttle"] = 1
        self.app.conf.broker_transport_options = transport
        self.drain = DrainState()
        self.cache = WeightCache(self.client, opts.cache_dir, opts.device, keep_versions=opts.keep_versions,
                                 keep_disk_versions=opts.keep_versions + 1, metrics=self.metrics,
                                 shared_blob_dir=opts.shared_blob_dir)
        self.runtime = ProbeRuntime(self.client, self.worker_id, self.cache, self.metrics,
                                    probe_path=opts.probe_path)
        register_probe_task(self.app, self.runtime, self.drain, self.metrics)
        warm_up()
        self.queues = list(self.reg.queues)
        self.consumed = set(self.queues or [IDLE_QUEUE])
        self._stop = threading.Event()
        self._prefetched: dict[str, int] = {}
        self._gpu_util = gpu_utilization_reader(opts.device) if opts.yield_gpu_util_pct else None
        self._busy_policy = BusyPolicy(opts.yield_gpu_util_pct) if opts.yield_gpu_util_pct else None
        self._control = threading.Thread(target=self._control_loop, name="sparecycles-control", daemon=True)

    # ---- control loop ------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        hb = Heartbeat(busy=self.runtime.busy, version=self.runtime.current_version,
                       tasks_done=self.runtime.tasks_done)
        try:
            reply = self.hb_client.heartbeat(self.worker_id, hb)
        except CoordinatorHTTPError as exc:
            if exc.status in (401, 403, 404):  # deleted or unknown to the coordinator: take no more work
                log.error("coordinator no longer knows this worker (%s); draining", exc.status)
                self.drain.set_remote(True)
            else:
                log.warning("heartbeat failed: %s", exc)
            return
        except Exception as exc:  # noqa: BLE001 - coordinator down: keep working, retry at the next tick
            log.warning("heartbeat failed: %s", exc)
            return
        self.queues = list(reply.queues)
        self.drain.set_remote(reply.state in ("draining", "quarantined"))

    def _reconcile(self) -> None:
        want = set() if self.drain.draining else set(self.queues)
        if not want and not self.drain.draining:
            want = {IDLE_QUEUE}
        self.metrics.draining.set(1 if self.drain.draining else 0)
        for q in sorted(want - self.consumed):
            self.app.control.add_consumer(q, destination=[self.hostname], reply=False)
            self.consumed.add(q)
            log.info("consuming %s", q)
        for q in sorted(self.consumed - want):
            self.app.control.cancel_consumer(q, destination=[self.hostname], reply=False)
            self.consumed.discard(q)
            log.info("stopped consuming %s", q)

    def _prefetch_loop(self) -> None:
        # Load each consumed run's latest published version before its first round arrives, so a new
        # version is ready on every worker shortly after publishing (not at the first task). With one run
        # consumed (the usual case) each check is a long poll (GET /v1/runs/{run}?newer_than=&wait_s=): a new
        # version starts loading within ~50 ms of its registration; with several, each is checked once per
        # prefetch interval. A coordinator that ignores the long poll answers at once and is polled per interval.
        wait = 0.0
        while not self._stop.wait(wait):
            wait = self.opts.prefetch_interval_s
            if self.drain.draining:
                continue
            runs = [q.rsplit(".", 1)[-1] for q in sorted(self.consumed - {IDLE_QUEUE})]  # "<prefix>.<run>"
            long_poll = LONG_POLL_S if len(runs) == 1 else 0.0
            for run in runs:
                try:
                    t0 = time.monotonic()
                    seen = self._prefetched.get(run, -1)
                    latest = self.client.run_info(run, newer_than=seen, wait_s=long_poll).latest_version
                    if latest > seen:  # each version once: no LRU thrash across runs
                        self._prefetched[run] = latest
                        self.runtime.prefetch(run, latest)  # not while a task's probe swaps weights in
                        self.drain.changed.set()  # heartbeat now: the coordinator (and `up`) see the version
                    if long_poll and (latest > seen or time.monotonic() - t0 >= long_poll / 2):
                        wait = 0.0  # the long poll did the waiting
                except Exception as exc:  # noqa: BLE001 - a ledger-only version or a hiccup: tasks load lazily
                    log.debug("prefetch of run %s skipped: %s", run, exc)

    def _control_loop(self) -> None:
        while not self._stop.is_set():
            self.drain.changed.clear()
            if self._gpu_util is not None:
                try:
                    self.drain.set_policy(self._busy_policy.update(self._gpu_util(), self.runtime.busy))
                except Exception as exc:  # noqa: BLE001 - NVML hiccup: keep the last decision
                    log.warning("GPU utilization unreadable: %s", exc)
            self._heartbeat()
            try:
                self._reconcile()
            except Exception as exc:  # noqa: BLE001 - broker hiccup: try again next tick
                log.warning("queue reconcile failed: %s", exc)
            self.drain.changed.wait(self.opts.control_interval_s)

    # ---- process -----------------------------------------------------------------------------------

    def _on_ready(self, sender=None, **_: object) -> None:
        # Installed after Celery's own handlers, so these win; handlers only flip flags (signal-safe).
        signal.signal(signal.SIGUSR1, lambda *_: self.drain.set_local(True))
        signal.signal(signal.SIGUSR2, lambda *_: self.drain.set_local(False))
        if not self._control.is_alive():
            self._control.start()
            if self.opts.prefetch_interval_s > 0:
                threading.Thread(target=self._prefetch_loop, name="sparecycles-prefetch", daemon=True).start()
        log.info("worker %s ready on %s, queues %s", self.worker_id, self.opts.device, sorted(self.consumed))

    def run(self) -> None:
        """Start metrics (optional), the Celery worker and the control loop; block until shutdown."""
        if self.opts.metrics_port:
            serve_metrics(self.opts.metrics_port, self.opts.metrics_host)
        worker_ready.connect(self._on_ready, weak=False)
        argv = [
            "worker", "--pool=solo", "--concurrency=1", "--prefetch-multiplier=1",
            "-Q", ",".join(sorted(self.consumed)), "-n", self.hostname, f"--loglevel={self.opts.loglevel}",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]
        try:
            self.app.worker_main(argv)
        finally:
            self._stop.set()
            self.drain.changed.set()
            try:
                self.client.request("DELETE", f"/v1/workers/{self.worker_id}")
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                log.warning("could not deregister: %s", exc)
            self.client.close()
            self.hb_client.close()
