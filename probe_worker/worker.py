"""A probe worker process: register over REST, heartbeat, run an in-process Celery worker, drain on request.

Lifecycle: `POST /v1/workers` with the enrollment token returns the broker URL, the run queues and
timings; the Celery app is built from those (`coordinator.celery_app.make_celery`: JSON only, late
acks, reject on worker lost, prefetch 1, visibility timeout from the coordinator, soft shutdown) and
started with `--pool=solo` (one process per device: CUDA does not survive fork).

A control thread heartbeats every `control_interval` seconds and reconciles the consumed queues with what
the worker should consume: the coordinator's queue list, or nothing while drained (`coordinator_drain`: state
'draining'/'quarantined'; `operator_drain`: SIGUSR1 until SIGUSR2; `gpu_busy`, optionally: other processes keep the GPU
busy; docs/operations.md names each reason). Queues are added and cancelled
through Celery's remote control addressed to this worker only (a command lost on the way, sent while the broker was
away, is sent again: each reconcile compares with what the in-process consumer consumes); a task delivered before a cancel
takes effect is handed back (rejected with requeue) unevaluated, and the in-flight task always
finishes. SIGTERM is Celery's warm shutdown: it waits for the running task however long (`soft_shutdown` is the
wait of a cold one, SIGQUIT or a second SIGINT, before it cuts the task); a weight load in progress (a task's, the
prefetch's) stops before its next shard (a task's goes back to its queue: WeightCache.stopping); the worker then
deregisters.

A coordinator that no longer knows the worker (heartbeat 401 "unknown token" / 404 "unknown worker": its Redis
came back empty, a failover, a flush, an admin's DELETE) is joined again with the enrollment token under a new
id, with bounded backoff (`ProbeWorker._reenroll`; ops/RUNBOOK.md "store-lost").
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from typing import NoReturn

from celery.signals import worker_ready
from tenacity import RetryCallState, RetryError, Retrying, stop_when_event_set, wait_exponential, wait_fixed

from coordinator.client import CoordinatorClient, CoordinatorHTTPError, Forgotten
from probe_worker.assembly import (
    ADOPT_ENV,
    PREFETCH_THREAD,
    REENROLLED_ENV,
    WorkerParts,
    build_parts,
)
from probe_worker.drain_signals import DrainSignals
from probe_worker.freeze import FreezeLink, watcher_rates, why_no_watcher
from probe_worker.metrics import serve_metrics
from probe_worker.options import WorkerOptions
from probe_worker.preemption import Preempted
from probe_worker.priority import lower_session_priority, lower_thread_priority
from probe_worker.tasks import NOT_TAKING_TASKS, BusyPolicy
from wire.messages import Heartbeat, WorkerRegistered, WorkerRegistration
from wire.teacher_messages import TEACHER_QUEUE_PREFIX

REENROLL_MAX_WAIT_S = 30.0  # the longest wait between two re-enrollment attempts (exponential backoff below)
RESTART_TASK_WAIT_S = 60.0  # the longest a re-enrolling worker waits for its running task before it restarts
ACK_SETTLE_S = 0.5  # then for the solo pool to ack or requeue that task's message
LONG_POLL_S = 2.0  # a prefetch long poll's wait (short: a stopping coordinator waits for pending ones)
log = logging.getLogger("sparecycles.worker")
COMMAND_SETTLE_S = 2.0  # seconds a queue command is given to reach the consumer before it counts as lost
IDLE_QUEUE = "sparecycles.idle"  # consumed only while no run queue exists (Celery needs at least one)


class ProbeWorker:
    """One registered worker. `run()` blocks until Celery shuts down (SIGTERM/SIGINT), then deregisters.

    Build one with `ProbeWorker.create(opts)` (registers over HTTP and builds the parts:
    probe_worker.assembly.build_parts); the constructor takes built `WorkerParts` and does no I/O.
    """

    def __init__(self, parts: WorkerParts) -> None:
        opts = self.opts = parts.opts
        self.host, self.name, self.metrics = parts.host, parts.name, parts.metrics
        self.reg, self.reenrolled, self.worker_id = parts.reg, parts.reenrolled, parts.reg.worker_id
        self.client, self.hb_client, self.app = parts.client, parts.hb_client, parts.app
        self.hostname = f"{self.worker_id}@{self.host}"
        self.drain, self.cache, self.runtime, self.serving = parts.drain, parts.cache, parts.runtime, parts.serving
        self._drain_signals = DrainSignals(self.drain)  # SIGUSR1 drains, SIGUSR2 resumes
        self.queues = list(self.reg.queues)
        self.teacher_queues = list(self.reg.teacher_queues)
        self.consumed = set(self._wanted()) or {IDLE_QUEUE}
        self._stop = parts.stop
        self._hb_state: str | None = None  # the heartbeat's last state, logged when it changes
        self._prefetched: dict[str, int] = {}
        self._gpu_util = parts.gpu_util
        self._busy_policy = BusyPolicy(opts.yield_gpu_util) if opts.yield_gpu_util else None
        self._control = threading.Thread(target=self._control_loop, name="sparecycles-control", daemon=True)
        self._celery = None  # the in-process Celery consumer (worker_ready's sender): what it really consumes
        self._commanded_at = 0.0  # monotonic time of the last add/cancel command sent

    @classmethod
    def create(cls, opts: WorkerOptions) -> ProbeWorker:
        """Register with the coordinator and build a worker from `opts` (probe_worker.assembly.build_parts).

        Raises CoordinatorHTTPError/httpx errors if registration fails, ValueError for a
        coordinator that names a different probe task.
        """
        return cls(build_parts(opts))

    def _wanted(self) -> set[str]:
        """The queues to consume when not draining: the coordinator's probe and teacher queues, --teacher-queue's."""
        return set(self.queues) | set(self.teacher_queues) | set(self.opts.teacher_queues)

    # ---- control loop ------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        hb = Heartbeat(busy=self.runtime.busy, version=self.runtime.current_version,
                       tasks_done=self.runtime.tasks_done,
                       serving=self.serving.figures() if self.serving is not None else None)
        try:
            reply = self.hb_client.heartbeat(self.worker_id, hb)
        except Forgotten as exc:  # the coordinator lost its state, or an admin deleted this worker: join again
            self._reenroll(exc)
            return
        except CoordinatorHTTPError as exc:
            if exc.status in (401, 403, 404):  # refused for another reason: take no more work
                self._heartbeat_state("refused", f"coordinator refuses this worker's heartbeat ({exc}); draining",
                                      logging.ERROR)
                self.drain.set_coordinator_drain(True)
            else:
                self._heartbeat_state(f"http {exc.status}", f"heartbeat failed: {exc}; retrying")
            return
        except Exception as exc:  # noqa: BLE001 - coordinator down: keep working, retry at the next tick
            self._heartbeat_state(type(exc).__name__, f"heartbeat failed: {exc}; retrying every "
                                  f"{self.opts.control_interval:g} s")
            return
        self._heartbeat_state("ok", "heartbeats answered again")
        self.queues, self.teacher_queues = list(reply.queues), list(reply.teacher_queues)
        self.drain.set_coordinator_drain(reply.state in ("draining", "quarantined"))

    def _heartbeat_state(self, state: str, message: str, level: int = logging.WARNING) -> None:
        """Log `message` only when the heartbeat's state changes (not twice a second while it persists)."""
        if state != self._hb_state:
            if not (state == "ok" and self._hb_state is None):
                log.log(logging.INFO if state == "ok" else level, message)
            self._hb_state = state

    # ---- re-enrollment -------------------------------------------------------------------------------

    def _reenroll(self, why: Forgotten) -> None:
        """Join the fleet again with the enrollment token, as a new worker id, after the coordinator forgot this one
        (its Redis came back empty, a failover, a flush, or an admin's DELETE).

        Keeps its queues (a task taken meanwhile is refused as from an unknown worker and requeued) and registers with
        bounded exponential backoff (`REENROLL_MAX_WAIT_S`, plus a per-name offset so a fleet does not retry in
        step); one log line per state change. The same broker URL: the identity is swapped in place (loaded weights
        kept). Other broker credentials (a per-worker ACL user, `SPARECYCLES_BROKER_ACL`): the process restarts
        itself with the new registration (`_restart_as`). Counted in sparecycles_worker_reenrollments_total.
        """
        old = self.worker_id
        log.warning("coordinator no longer knows this worker %s (%s); re-enrolling with the enrollment token",
                    old, why.status)
        self._hb_state = "forgotten"
        # The queues are not cancelled here: Celery's control messages are fire-and-forget, and a cancel followed
        # ~25 ms later by the add of the same queue (the run is re-created at once) could leave Celery not
        # consuming a queue this worker believes it consumes (a re-issued round then sat unconsumed until its
        # deadline). A task taken meanwhile is refused as from an unknown worker and requeued.
        self.drain.set_coordinator_drain(True)
        reg = self._register_with_backoff()
        if reg is None:  # shutting down
            return
        self.reenrolled += 1
        self.metrics.reenrollments.inc()
        if reg.broker_url != self.reg.broker_url:
            self._restart_as(reg)
        self.reg, self.worker_id, self.queues = reg, reg.worker_id, list(reg.queues)
        self.teacher_queues = list(reg.teacher_queues)
        self.client.token = self.hb_client.token = reg.worker_token
        self.runtime.rebind(reg.worker_id)
        self._prefetched.clear()  # runs re-created by their trainer publish their versions again
        self.drain.set_coordinator_drain(False)
        self._hb_state = "ok"
        log.warning("re-enrolled as %s (was %s)", reg.worker_id, old)

    def _register_with_backoff(self) -> WorkerRegistered | None:
        """Register until the coordinator accepts (None if the worker stops meanwhile); see `_reenroll`."""
        last = [""]

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            kind = f"{type(exc).__name__} {getattr(exc, 'status', '')}"
            if kind != last[0]:  # one line per kind of failure, not one per attempt
                last[0] = kind
                log.warning("re-enrollment failed (%s); retrying with backoff (at most %.0f s apart)",
                            str(exc)[:300], REENROLL_MAX_WAIT_S)

        offset_s = int(hashlib.sha256(self.name.encode()).hexdigest()[:4], 16) / 65536  # [0, 1) s, by name
        retrying = Retrying(wait=wait_exponential(multiplier=0.5, max=REENROLL_MAX_WAIT_S) + wait_fixed(offset_s),
                            stop=stop_when_event_set(self._stop), sleep=self._stop.wait, before_sleep=note)
        registration = WorkerRegistration(name=self.name[:128], device=self.opts.device, host=self.host)
        try:
            for attempt in retrying:
                with attempt, CoordinatorClient(self.opts.coordinator, attempts=1, timeout_s=10.0) as c:
                    return c.register(registration, self.opts.token)
        except RetryError:
            return None
        return None

    def _restart_as(self, reg: WorkerRegistered) -> NoReturn:
        """Replace this process by a fresh start of the same command that adopts `reg` (a running Celery worker
        cannot switch broker credentials): the registration travels in the environment, read once and removed at
        start (`probe_worker.assembly.adopted_registration`); the re-enrollment count too."""
        log.warning("re-enrolled as %s with new broker credentials; restarting the worker process", reg.worker_id)
        # A task cut by the exec would stay unacked in the broker until its visibility timeout (an hour): let the
        # running one end first (it is refused as from an unknown worker and requeued, or it finishes), and its ack
        # or requeue leave; the drain set by `_reenroll` hands back any task delivered meanwhile.
        deadline = time.monotonic() + RESTART_TASK_WAIT_S
        while self.runtime.busy and time.monotonic() < deadline:
            self._stop.wait(0.05)
        self._stop.wait(ACK_SETTLE_S)
        os.environ[ADOPT_ENV] = reg.model_dump_json()
        os.environ[REENROLLED_ENV] = str(self.reenrolled)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if self.drain.preemption.freeze is not None:  # the new process starts its own; this one's would go on reading
            self.drain.preemption.freeze.close()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

    def _celery_queues(self) -> set[str] | None:
        """The queues the in-process Celery consumer consumes now (None before it is ready)."""
        task_consumer = getattr(self._celery, "task_consumer", None)
        return None if task_consumer is None else {q.name for q in list(task_consumer.queues)}

    def _resync_consumed(self) -> None:
        # add/cancel are broadcast through the broker (reply=False): one sent while it was away (a Redis restart)
        # is lost, and the worker would believe it consumes a run queue it does not. Trust what Celery consumes once
        # the last command had time to apply; the reconcile then sends the difference again.
        actual = self._celery_queues()
        if actual is None or actual == self.consumed or time.monotonic() - self._commanded_at < COMMAND_SETTLE_S:
            return
        log.warning("the consumer takes %s, not %s (a queue command was lost): sending it again",
                    sorted(actual), sorted(self.consumed))
        self.consumed = actual

    def _reconcile(self) -> None:
        self._resync_consumed()
        # the serving engine's gate keeps the probe queues (run_probe holds a task delivered meanwhile: DrainState.drained)
        want = set() if self.drain.drained else set(self.queues) if self.drain.engine_busy else self._wanted()
        if not want and self.drain.taking_tasks:
            want = {IDLE_QUEUE}
        self.metrics.draining.set(1 if not self.drain.taking_tasks else 0)
        reasons = self.drain.reasons()
        for reason in NOT_TAKING_TASKS:
            self.metrics.not_taking.labels(reason).set(1 if reason in reasons else 0)
        for q in sorted(want - self.consumed):
            self.app.control.add_consumer(q, destination=[self.hostname], reply=False)
            self._commanded_at = time.monotonic()
            self.consumed.add(q)
            log.info("consuming %s", q)
        for q in sorted(self.consumed - want):
            self.app.control.cancel_consumer(q, destination=[self.hostname], reply=False)
            self._commanded_at = time.monotonic()
            self.consumed.discard(q)
            log.info("stopped consuming %s (%s)", q, ", ".join(reasons) or "not wanted")

    def _prefetch_loop(self) -> None:
        # Load each consumed run's latest published version before its first round arrives, so a new
        # version is ready on every worker shortly after publishing (not at the first task). With one run
        # consumed (the usual case) each check is a long poll (GET /v1/runs/{run}?newer_than=&wait_s=): a new
        # version starts loading within ~50 ms of its registration; with several, each is checked once per
        # prefetch interval. A coordinator that ignores the long poll answers at once and is polled per interval.
        wait = 0.0
        while not self._stop.wait(wait):
            wait = self.opts.prefetch_interval
            if not self.drain.taking_tasks:
                continue
            probe_queues = {q for q in self.consumed - {IDLE_QUEUE, *self.opts.teacher_queues}
                            if not q.startswith(TEACHER_QUEUE_PREFIX + ".")}
            runs = [q.rsplit(".", 1)[-1] for q in sorted(probe_queues)]  # "<prefix>.<run>"
            long_poll = LONG_POLL_S if len(runs) == 1 else 0.0
            for run in runs:
                try:
                    t0 = time.monotonic()
                    seen = self._prefetched.get(run, -1)
                    latest = self.client.run_info(run, newer_than=seen, wait_s=long_poll).latest_version
                    if latest > seen:  # each version once: no LRU thrash across runs
                        self._prefetched[run] = latest
                        self.runtime.prefetch(run, latest)  # a snapshot loads beside a task; a replay waits for it
                        self.drain.changed.set()  # heartbeat now: the coordinator (and `up`) see the version
                    if long_poll and (latest > seen or time.monotonic() - t0 >= long_poll / 2):
                        wait = 0.0  # the long poll did the waiting
                except Preempted:  # a replay stopped for the serving engine: the next check goes on from there
                    self._prefetched[run] = seen
                except Exception as exc:  # noqa: BLE001 - a ledger-only version or a hiccup: tasks load lazily
                    log.debug("prefetch of run %s skipped: %s", run, exc)

    def _control_loop(self) -> None:
        while not self._stop.is_set():
            self.drain.changed.clear()
            if self._gpu_util is not None:
                try:
                    self.drain.set_gpu_busy(self._busy_policy.update(self._gpu_util(), self.runtime.busy))
                except Exception as exc:  # noqa: BLE001 - NVML hiccup: keep the last decision
                    log.warning("GPU utilization unreadable: %s", exc)
            self._heartbeat()
            try:
                self._reconcile()
            except Exception as exc:  # noqa: BLE001 - broker hiccup: try again next tick
                log.warning("queue reconcile failed: %s", exc)
            self.drain.changed.wait(self.opts.control_interval)

    # ---- process -----------------------------------------------------------------------------------

    def _lower_priority(self) -> None:
        """The task thread's nice and policy (it and the threads it starts later), and the process's autogroup."""
        nice, idle = self.opts.task_nice, self.opts.sched_idle
        if not (nice or idle):
            return
        lower_thread_priority(nice, idle)
        why_not = lower_session_priority(nice or 19)
        if why_not:
            log.warning("CPU priority: tasks at nice %d%s, but %s", nice, " under SCHED_IDLE" if idle else "", why_not)
        else:
            log.info("CPU priority: tasks at nice %d%s, this session's autogroup at nice %d", nice,
                     " under SCHED_IDLE" if idle else "", nice or 19)

    def _start_freeze_watcher(self) -> None:
        """Beside an engine (--serving-freeze > 0): the process that stops this worker while the engine serves during a
        task (probe_worker.freeze), for at most a third of the lease; only where the worker leads its session (as for
        its autogroup, probe_worker.priority), and none where the platform lacks memfd."""
        policy = self.opts.serving
        if policy is None or policy.freeze_s <= 0:
            return
        why_not = why_no_watcher()
        if why_not:
            log.warning("no freeze watcher: %s; its tasks are cut in process only", why_not)
            return
        max_s = min(policy.freeze_s, self.reg.lease_seconds / 3)
        try:
            rates = watcher_rates(policy.interval_s, self.opts.control_interval, max_s)
            self.drain.preemption.freeze = FreezeLink(policy, rates, max_s,
                                                      self.opts.task_trace)
        except Exception as exc:  # noqa: BLE001 - e.g. no os.memfd_create (not Linux): never the worker's priority
            log.warning("no freeze watcher (%s): tasks are cut in process only", exc)
            return
        log.info("freeze watcher %d stops this worker while the engine serves during a task (at most %g s)",
                 self.drain.preemption.freeze.proc.pid, max_s)

    def _on_ready(self, sender=None, **_: object) -> None:
        self._celery = sender
        self._drain_signals.install()  # after Celery's own handlers, so these win; in the order they arrive
        if not self._control.is_alive():
            # Before the priority drops below: the engine's watch and the heartbeats keep the normal priority, so a
            # starved task thread (SCHED_IDLE on a busy core) never lets the worker's lease lapse.
            if self.serving is not None:
                threading.Thread(target=self.serving.run, args=(self._stop, self.opts.control_interval),
                                 name="sparecycles-serving", daemon=True).start()
            self._control.start()
            self._start_freeze_watcher()  # before the priority drops: it keeps the normal priority
            self._lower_priority()
            if self.opts.prefetch_interval > 0:
                threading.Thread(target=self._prefetch_loop, name=PREFETCH_THREAD, daemon=True).start()
        log.info("worker %s ready on %s, queues %s", self.worker_id, self.opts.device, sorted(self.consumed))

    def run(self) -> None:
        """Start metrics (optional), the Celery worker and the control loop; block until shutdown."""
        if self.opts.metrics_port:
            serve_metrics(self.opts.metrics_port, self.opts.metrics_host)
        worker_ready.connect(self._on_ready, weak=False)
        argv = [
            "worker", "--pool=solo", "--concurrency=1", "--prefetch-multiplier=1",
            "-Q", ",".join(sorted(self.consumed)), "-n", self.hostname, f"--loglevel={self.opts.log_level}",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]
        try:
            self.app.worker_main(argv)
        finally:
            self._stop.set()
            self.drain.changed.set()
            if self.drain.preemption.freeze is not None:
                self.drain.preemption.freeze.close()
            try:
                self.client.request("DELETE", f"/v1/workers/{self.worker_id}")
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                log.warning("could not deregister: %s", exc)
            self.client.close()
            self.hb_client.close()
