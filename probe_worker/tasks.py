"""The Celery task `sparecycles.probe`: JSON kwargs (a `ProbeTask`) in, results posted to the coordinator.

Delivery rules (DESIGN.md section 3): late ack and reject-on-worker-lost, so a killed worker's task is
redelivered; the task is idempotent (evaluation is deterministic and intake dedupes by (round, seed)),
so redelivery only costs compute. Outcomes, each counted in `sparecycles_worker_tasks_total{outcome}`:

- `done`: evaluated and posted (whatever the per-result intake outcomes were);
- `invalid`: kwargs are not a valid ProbeTask, the round's batch blob is malformed or does not fit the
  version's model (wire.batch.BatchFormatError), or its blocks or slices do not (a group or group_line
  round naming a block the model lacks or a slice outside a block: trainer.zo.probes.ProbeFitError) ->
  rejected without requeue, never retried (another worker would refuse the same bytes);
- `refused`: the coordinator refused a call with a 4xx, or the version is neither a snapshot nor reachable
  by the seed ledger -> dropped;
- `corrupt`: a shard kept arriving corrupt -> dropped (the coordinator re-dispatches what it misses);
- `handed_back`: a spot-check replica of seeds this worker already evaluated in another replica ->
  an identical copy is republished and this delivery acknowledged after a short pause, so that an
  idle worker takes the copy (bounded per seed and replica; then it is evaluated here anyway);
- `requeued`: the worker is not taking tasks (a drain, or `engine_busy` past the hold: NOT_TAKING_TASKS), the coordinator no longer knows it (it re-enrolls), the
  coordinator/broker stayed unreachable after bounded retries, or the worker is stopping and its weight load stopped
  (probe_worker.cache.LoadStopped) -> rejected with requeue, so another worker (or this one later) evaluates it;
- `preempted`: cut (`cut`) mid-evaluation because the co-located serving engine got requests
  (probe_worker.serving) -> nothing posted, rejected with requeue: the round's task is evaluated again later;
- `withdrawn`: the task's round was closed on the coordinator (the trainer took it over or the run ended) ->
  acknowledged unevaluated (ProbeRuntime.withdrawn);
- `error`: any other failure (a bug, out of memory) -> dropped after logging, the worker lives on.

A requeue is an expected hand-back (`HandBack`), no error: the task logs one line naming the task, its round and why
(INFO; WARNING when the coordinator is out of reach or forgot the worker), and Celery's own record of the Reject, a
WARNING with a traceback, is dropped (`quiet_hand_backs`). Invalid tasks and real errors keep their tracebacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from celery import Celery, Task
from celery.exceptions import Reject
from pydantic import ValidationError

from coordinator.celery_app import PROBE_TASK_NAME
from coordinator.client import CoordinatorHTTPError, CorruptBlobError, Forgotten, is_transient
from probe_worker.cache import LoadStopped, VersionUnavailable
from probe_worker.metrics import WorkerMetrics
from probe_worker.preemption import Preempted, Preemption
from probe_worker.runtime import ProbeRuntime
from probe_worker.task_checks import parse_task
from trainer.zo.probes import ProbeFitError
from wire.batch import BatchFormatError
from wire.round_messages import ProbeTask

log = logging.getLogger("sparecycles.worker")

REQUEUE_PAUSE_S = 0.2  # keep a draining worker from spinning on a task it keeps handing back
SERVING_HOLD_CAP_S = 10.0  # how long a task delivered while the serving engine is busy waits for it before requeue
HAND_BACK_PAUSE_S = 0.5


class HandBack(Reject):
    """An expected hand-back: the task goes back to its queue (Reject with requeue) for a reason that is no error
    (the serving engine needs the device, the worker drains, the coordinator is out of reach for now). `reason`
    names the round and why; `level` is the logging level of the one line the task logs for it (`log_hand_back`)."""

    def __init__(self, reason: str, level: int = logging.INFO) -> None:
        super().__init__(reason, requeue=True)
        self.level = level


class _QuietHandBacks(logging.Filter):
    """Drops Celery's record of a HandBack: celery.app.trace logs every Reject as a WARNING with its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(record.exc_info[1] if record.exc_info else None, HandBack)


_QUIET = _QuietHandBacks()


def quiet_hand_backs() -> None:
    """Install the filter that drops Celery's traceback of a HandBack (idempotent; `log_hand_back` says it once)."""
    logging.getLogger("celery.app.trace").addFilter(_QUIET)


def log_hand_back(task_name: str, task_id: str | None, exc: HandBack) -> None:
    """The one line a handed-back task logs: "probe task <id> handed back to its queue: round R seeds S: why"."""
    log.log(exc.level, "%s task %s handed back to its queue: %s", task_name, task_id, exc.reason)


# Why a worker is not taking tasks, one name each (docs/operations.md, "Why a worker takes no task"): its log lines,
# the `sparecycles_worker_not_taking_tasks{reason}` gauge and DrainState's attributes use these names.
OPERATOR_DRAIN = "operator_drain"  # SIGUSR1 on the worker, until SIGUSR2 (probe_worker.drain_signals)
COORDINATOR_DRAIN = "coordinator_drain"  # the coordinator's state 'draining'/'quarantined', or it refused a heartbeat
GPU_BUSY = "gpu_busy"  # --yield-gpu-util: other processes keep the GPU busy (BusyPolicy)
ENGINE_BUSY = "engine_busy"  # --serving-metrics: the co-located engine's gate (probe_worker.serving.EngineGate)
SHUTTING_DOWN = "shutting_down"  # Celery's warm or cold shutdown began (SIGTERM, SIGINT, SIGQUIT)
NOT_TAKING_TASKS = (OPERATOR_DRAIN, COORDINATOR_DRAIN, GPU_BUSY, ENGINE_BUSY, SHUTTING_DOWN)
# How a running (or delivered) task stops short, one name each: `hand back` (HandBack: rejected with requeue, back to
# its queue), `cut` (probe_worker.preemption.Preempted: stopped mid-evaluation at the next block, then handed back; task
# outcome `preempted`), `freeze` (probe_worker.freeze: the whole process stopped with SIGSTOP while the engine serves,
# resumed with SIGCONT; the task goes on).
HAND_BACK, CUT, FREEZE = "hand_back", "cut", "freeze"


class DrainState:
    """Why this worker is not taking tasks (NOT_TAKING_TASKS), one flag per reason, and the task stops that go with
    them. Drains (`operator_drain`, `coordinator_drain`, `gpu_busy`) cancel the worker's queues and hand back what was
    delivered; `engine_busy` keeps the probe queues and holds a delivered task for the engine (run_probe), cutting a
    running one (`preemption`); `shutting_down` is Celery's own state (`shutting_down()`).

    Thread-safe; `changed` is set on every transition so the control loop reacts at once. `engine_idle` is set while
    the engine lets the worker take tasks. `preemption` cuts a running task short (serving only) and keeps the busy
    clock; `last_outcome` is the last task's outcome name.
    """

    def __init__(self) -> None:
        self.operator_drain = False
        self.coordinator_drain = False
        self.gpu_busy = False
        self.engine_busy = False
        self.changed = threading.Event()
        self.engine_idle = threading.Event()  # set while the serving engine lets the worker take tasks
        self.engine_idle.set()
        self.preemption = Preemption()
        self.last_outcome = ""

    @property
    def drained(self) -> bool:
        """True while a drain holds (operator, coordinator or GPU-busy): the queues are cancelled. The engine's gate
        is no drain: it only holds the task delivered (run_probe), as cancelling and re-adding a queue in quick
        succession, as a serving gate does, can leave Celery not consuming it."""
        return self.operator_drain or self.coordinator_drain or self.gpu_busy

    @property
    def taking_tasks(self) -> bool:
        """False while any reason of NOT_TAKING_TASKS but `shutting_down` holds: tasks must not be started."""
        return not (self.drained or self.engine_busy)

    def reasons(self) -> list[str]:
        """The reasons (NOT_TAKING_TASKS' names, in that order) that hold now; empty while the worker takes tasks."""
        flags = [self.operator_drain, self.coordinator_drain, self.gpu_busy, self.engine_busy, shutting_down()]
        return [name for name, on in zip(NOT_TAKING_TASKS, flags, strict=True) if on]

    def set_operator_drain(self, value: bool) -> None:
        """Drain (True: SIGUSR1) or resume (False: SIGUSR2) on the operator's request; safe from a signal handler."""
        self.operator_drain = value
        self.changed.set()

    def set_coordinator_drain(self, value: bool) -> None:
        """Record the coordinator's view (state 'draining' or 'quarantined', or a refused heartbeat -> True)."""
        if value != self.coordinator_drain:
            self.coordinator_drain = value
            self.changed.set()

    def set_gpu_busy(self, value: bool) -> None:
        """Record the GPU-busy policy's decision (BusyPolicy)."""
        if value != self.gpu_busy:
            self.gpu_busy = value
            self.changed.set()

    def set_engine_busy(self, value: bool) -> None:
        """Record the serving engine's gate (probe_worker.serving.EngineGate: True while it needs the device)."""
        if value != self.engine_busy:
            self.engine_busy = value
            (self.engine_idle.clear if value else self.engine_idle.set)()
            self.changed.set()


def shutting_down() -> bool:
    """This Celery worker received its warm or cold shutdown signal (celery.worker.state)."""
    from celery.worker import state

    return state.should_stop is not None or state.should_terminate is not None


def run_probe(runtime: ProbeRuntime, drain: DrainState, metrics: WorkerMetrics, kwargs: Any,
              hand_off: Callable[[dict[str, Any]], None] | None = None) -> str:
    """Handle one delivery of a probe task; returns the outcome name.

    `hand_off(kwargs)` republishes a task for another worker (spot-check replicas of seeds this worker
    already evaluated); None disables hand-offs.

    Raises celery.exceptions.Reject without requeue for invalid tasks (logged here), HandBack (a Reject with requeue,
    its reason naming the round; logged by the caller, `log_hand_back`) for the draining, yielding, cut,
    unreachable and stopping (a weight load stopped by the worker's shutdown: probe_worker.cache.LoadStopped) cases; every other failure is logged and reported as an outcome, never raised. Delivered while only
    the serving engine holds the worker back, the task waits for it (at most SERVING_HOLD_CAP_S) before that.
    """
    outcome = _outcome_counter(drain, metrics)
    task = _parse_or_reject(kwargs, outcome)
    _hold_or_hand_back(task, drain, outcome)
    if runtime.withdrawn(task):  # its round was closed (taken over by the trainer, or the run ended): skip, quietly
        log.debug("round %s was withdrawn; task skipped", task.round_id)
        return outcome("withdrawn")
    if hand_off is not None and runtime.should_hand_back(task):
        hand_off(kwargs)  # an identical copy goes back on the queue now...
        time.sleep(HAND_BACK_PAUSE_S)  # ...while this worker stays busy, so an idle one takes it
        return outcome("handed_back")
    drain.preemption.arm()
    try:
        reply = runtime.run_task(task)
    except Preempted:
        outcome("preempted")
        raise HandBack(f"{_which(task)}: {CUT} ({ENGINE_BUSY}): the serving engine needs the device") from None
    except Exception as exc:  # noqa: BLE001 - each failure is sorted into an outcome (or a Reject) by _failed
        return _failed(task, exc, drain, outcome)
    finally:
        drain.preemption.disarm()
    log.info("round %s seeds %s replica %d -> %s", task.round_id, task.seeds, task.replica, reply.outcomes)
    return outcome("done")


def _which(task: ProbeTask) -> str:
    """How a hand-back names its task: "round R seeds S"."""
    return f"round {task.round_id} seeds {task.seeds}"


def _outcome_counter(drain: DrainState, metrics: WorkerMetrics) -> Callable[[str], str]:
    """`outcome(name)`: counts a task's outcome (sparecycles_worker_tasks_total{outcome}), records it as the
    drain's `last_outcome` and returns it."""

    def outcome(name: str) -> str:
        metrics.tasks.labels(name).inc()
        drain.last_outcome = name
        return name

    return outcome


def _parse_or_reject(kwargs: Any, outcome: Callable[[str], str]) -> ProbeTask:
    """The task's `ProbeTask`; raises Reject without requeue (outcome `invalid`, logged) for invalid kwargs."""
    try:
        return parse_task(kwargs)
    except (ValidationError, ValueError, TypeError) as exc:
        outcome("invalid")
        log.warning("rejected an invalid probe task: %s", str(exc)[:500])
        raise Reject(f"invalid probe task: {str(exc)[:200]}", requeue=False) from None


def _hold_or_hand_back(task: ProbeTask, drain: DrainState, outcome: Callable[[str], str]) -> None:
    """Hold a task delivered while only the serving engine is busy (at most SERVING_HOLD_CAP_S); then raise HandBack
    (outcome `requeued`, after REQUEUE_PAUSE_S) if the worker is still not taking tasks."""
    if drain.engine_busy and not drain.drained:  # the engine is busy: hold this task until it has been idle for the hold
        drain.engine_idle.wait(SERVING_HOLD_CAP_S)
    if not drain.taking_tasks:
        outcome("requeued")
        time.sleep(REQUEUE_PAUSE_S)
        why = (", ".join(drain.reasons()) if drain.drained
               else f"{ENGINE_BUSY}: the serving engine stayed busy for {SERVING_HOLD_CAP_S:g} s")
        raise HandBack(f"{_which(task)}: not taking tasks ({why})")


def _failed(task: ProbeTask, exc: Exception, drain: DrainState, outcome: Callable[[str], str]) -> str:
    """Sort a failed evaluation: returns the outcome name (`refused`, `corrupt`, `error`), or raises HandBack
    (`requeued`: the coordinator forgot this worker or is out of reach, or the worker is stopping) or Reject without
    requeue (`invalid`: the batch or the round does not fit the model)."""
    if isinstance(exc, (httpx.TransportError, CoordinatorHTTPError)):
        return _coordinator_failed(task, exc, drain, outcome)
    if isinstance(exc, LoadStopped):  # the worker is stopping: its weight load stopped between shards, the task goes back
        outcome("requeued")
        raise HandBack(f"{_which(task)}: not taking tasks ({SHUTTING_DOWN}: its weight load stopped)") from None
    if isinstance(exc, VersionUnavailable):
        log.warning("round %s: %s", task.round_id, exc)
        return outcome("refused")
    if isinstance(exc, CorruptBlobError):
        log.error("round %s: %s", task.round_id, exc)
        return outcome("corrupt")
    if isinstance(exc, BatchFormatError):
        outcome("invalid")
        log.warning("rejected round %s: its batch %s", task.round_id, str(exc)[:500])
        raise Reject(f"invalid batch: {str(exc)[:200]}", requeue=False) from None
    if isinstance(exc, ProbeFitError):
        outcome("invalid")
        log.warning("rejected round %s: it does not fit the model: %s", task.round_id, str(exc)[:500])
        raise Reject(f"round does not fit the model: {str(exc)[:200]}", requeue=False) from None
    log.error("probe task of round %s failed", task.round_id, exc_info=exc)
    return outcome("error")


def _coordinator_failed(task: ProbeTask, exc: httpx.TransportError | CoordinatorHTTPError, drain: DrainState,
                        outcome: Callable[[str], str]) -> str:
    """A call to the coordinator failed: HandBack (requeued) if it forgot this worker (the control loop re-enrolls)
    or is out of reach for now; else it refused the task (a 4xx): outcome `refused`."""
    if isinstance(exc, Forgotten) and exc.what == "worker":  # the control loop re-enrolls; then it runs
        outcome("requeued")
        drain.changed.set()  # heartbeat now: it finds out and re-enrolls
        time.sleep(REQUEUE_PAUSE_S)
        raise HandBack(f"{_which(task)}: the coordinator no longer knows this worker (it re-enrolls)",
                       logging.WARNING) from None
    if is_transient(exc):
        outcome("requeued")
        raise HandBack(f"{_which(task)}: the coordinator is unreachable ({exc})", logging.WARNING) from None
    log.warning("coordinator refused round %s: %s", task.round_id, exc)
    return outcome("refused")


def register_probe_task(app: Celery, runtime: ProbeRuntime, drain: DrainState, metrics: WorkerMetrics,
                        trace: Callable[..., None] | None = None) -> Task:
    """Register `sparecycles.probe` on `app` (JSON only, acks_late, reject_on_worker_lost, no result).

    `trace(start, end, outcome, fired, where, stopped)` (unix seconds) is called after each delivery, however it ended
    (fired: when the serving engine first asked to cut it, None if it did not; where: where that found it; stopped:
    when the cut took effect, its evaluation's last moment: the hand-back follows, until `end`). A hand-back is
    logged as one line (`log_hand_back`; Celery's traceback of it dropped: `quiet_hand_backs`)."""
    quiet_hand_backs()

    @app.task(name=PROBE_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
              serializer="json", typing=False)
    def probe(self: Task, **kwargs: Any) -> str:
        queue = (self.request.delivery_info or {}).get("routing_key")

        def hand_off(kw: dict[str, Any]) -> None:
            app.send_task(PROBE_TASK_NAME, kwargs=kw, queue=queue, ignore_result=True)

        guard, start = drain.preemption, time.time()
        if trace is not None:
            drain.last_outcome, guard.fired_at, guard.armed_at, guard.stopped_at = "", None, None, None
        try:
            return run_probe(runtime, drain, metrics, kwargs, hand_off if queue else None)
        except HandBack as exc:
            log_hand_back("probe", self.request.id, exc)
            raise
        finally:  # a task held for the serving engine starts when it is evaluated
            if trace is not None:
                trace(guard.armed_at or start, time.time(), drain.last_outcome, guard.fired_at, guard.where,
                      guard.stopped_at, guard.watcher_stop())

    return probe


class BusyPolicy:
    """Yield the GPU to its serving load: drain while another process keeps the device busy.

    Feed `update(util_pct, self_busy)` one utilization reading (percent, 0..100) per control tick.
    Readings taken while this worker runs a task are ignored (its own kernels count in them). The
    worker drains after `n_on` consecutive idle readings >= `threshold_pct` and resumes after `n_off`
    consecutive readings below it (hysteresis, so a short serving burst does not flap the queue).
    Raises ValueError for a threshold outside (0, 100] or non-positive counts.
    """

    def __init__(self, threshold_pct: float, n_on: int = 2, n_off: int = 4) -> None:
        if not 0 < threshold_pct <= 100 or n_on < 1 or n_off < 1:
            raise ValueError("threshold_pct must be in (0, 100] and n_on, n_off >= 1")
        self.threshold_pct, self.n_on, self.n_off = threshold_pct, n_on, n_off
        self.yielding = False
        self._run = 0

    def update(self, util_pct: float, self_busy: bool) -> bool:
        """Record one reading; return whether the worker should be draining now."""
        if self_busy:
            return self.yielding
        hot = util_pct >= self.threshold_pct
        self._run = self._run + 1 if hot != self.yielding else 0
        if self._run >= (self.n_off if self.yielding else self.n_on):
            self.yielding, self._run = hot, 0
        return self.yielding


def gpu_utilization_reader(device: str) -> Callable[[], float]:
    """A function returning the current utilization (percent) of CUDA device `device` via NVML.

    Needs the `nvidia-ml-py` package; the index is NVML's (physical) one, so set it to match when
    CUDA_VISIBLE_DEVICES renumbers devices. Raises ValueError for a non-CUDA device.
    """
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"GPU-busy yielding needs a cuda device, got {device!r}")
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
