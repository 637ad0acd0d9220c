"""A probe worker's parts, built: all the I/O a `ProbeWorker` needs before it runs, so its constructor does none
(hivemind's `Server.create` builds what `Server.__init__` takes).

`build_parts(opts)` registers over HTTP (or adopts a restarted process's registration), builds the Celery app with its
broker transport options and the guarded transport, the weight cache, the evaluation runtime and the serving engine's
watch, registers the probe and teacher tasks on the app, reads the GPU utilization handle and imports the evaluation
stack (`warm_up`). `ProbeWorker.create(opts)` is `ProbeWorker(build_parts(opts))`.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from celery import Celery

from coordinator.celery_app import PROBE_TASK_NAME, make_celery
from coordinator.client import CoordinatorClient
from probe_kernels.reference import add_chunk_hook
from probe_worker.broker import TEACHER_FIRST, use_guarded_transport
from probe_worker.cache import WeightCache
from probe_worker.metrics import WorkerMetrics, default_metrics
from probe_worker.options import WorkerOptions
from probe_worker.preemption import Preempted
from probe_worker.runtime import ForwardSettings, ProbeRuntime
from probe_worker.serving import ServingWatch
from probe_worker.task_trace import TraceFile
from probe_worker.tasks import DrainState, gpu_utilization_reader, register_probe_task, shutting_down
from wire.messages import WorkerRegistered, WorkerRegistration

ADOPT_ENV = "SPARECYCLES_WORKER_ADOPT"  # a registration handed to the restarted process (ProbeWorker._restart_as)
REENROLLED_ENV = "SPARECYCLES_WORKER_REENROLLED"  # re-enrollments before that restart (the metric goes on)
PREFETCH_THREAD = "sparecycles-prefetch"  # the thread that loads versions ahead of their rounds


@dataclass
class WorkerParts:
    """What a ProbeWorker runs with, all built: its options, identity (`host`, `name`), registration (`reg`: the
    coordinator's answer; `reenrolled`: re-enrollments before this process), the task path's `client` (holding the
    worker token) and the heartbeats' `hb_client`, the Celery `app` (tasks registered), the `drain` state, the `stop`
    event its threads and weight loads watch, the weight `cache`, the evaluation `runtime`, the serving engine's watch
    (None without --serving-metrics) and the GPU utilization reader (None without --yield-gpu-util)."""

    opts: WorkerOptions
    host: str
    name: str
    metrics: WorkerMetrics
    reg: WorkerRegistered
    reenrolled: int
    client: CoordinatorClient
    hb_client: CoordinatorClient
    app: Celery
    drain: DrainState
    stop: threading.Event
    cache: WeightCache
    runtime: ProbeRuntime
    serving: ServingWatch | None
    gpu_util: Callable[[], float] | None


def adopted_registration() -> tuple[WorkerRegistered | None, int]:
    """The registration a restarting worker handed to its new process (`ProbeWorker._restart_as`), or None, and
    the re-enrollments before. Removed from the environment at once, so no child process inherits the token.
    """
    body = os.environ.pop(ADOPT_ENV, None)
    count = os.environ.pop(REENROLLED_ENV, "0")
    return (WorkerRegistered.model_validate_json(body) if body else None), int(count) if count.isdigit() else 0


def register(opts: WorkerOptions, client: CoordinatorClient, name: str, host: str,
             adopted: WorkerRegistered | None) -> WorkerRegistered:
    """`adopted`, else `POST /v1/workers` with the enrollment token; `client` then carries the worker token.
    Raises CoordinatorHTTPError/httpx errors if registration fails, ValueError for a coordinator that names a
    different probe task."""
    reg = adopted or client.register(WorkerRegistration(name=name[:128], device=opts.device, host=host), opts.token)
    client.token = reg.worker_token
    if reg.probe_task_name != PROBE_TASK_NAME:
        raise ValueError(f"coordinator sends task {reg.probe_task_name!r}; this worker runs "
                         f"{PROBE_TASK_NAME!r}; upgrade the worker")
    return reg


def broker_app(reg: WorkerRegistered, soft_shutdown_s: float) -> Celery:
    """The Celery app on the registration's broker (coordinator.celery_app.make_celery), its transport guarded (a bad
    queue item is dropped, not fatal: probe_worker.broker). kombu sweeps for expired unacked messages only every
    interval * throttle seconds (100 s by default); here at a fifth of the visibility timeout (1..10 s), so a killed
    worker's task returns promptly. Teacher rounds are taken before probe rounds (probe_worker.broker.TeacherFirstCycle).
    """
    app = make_celery(reg.broker_url, visibility_timeout_s=reg.visibility_timeout_s, soft_shutdown_s=soft_shutdown_s)
    transport = dict(app.conf.broker_transport_options or {})
    transport["queue_order_strategy"] = TEACHER_FIRST
    transport["unacked_restore_interval"] = max(1.0, min(10.0, reg.visibility_timeout_s / 5))
    transport["unacked_restore_throttle"] = 1
    app.conf.broker_transport_options = transport
    use_guarded_transport(app, reg.broker_url)
    return app


def warm_up() -> None:
    """Import the evaluation stack (torch, transformers' model base, kernels, the loss) before consuming.

    On a busy host these imports take seconds; paying them before the first task keeps that task well
    inside the visibility timeout (otherwise the broker would redeliver it to another worker).
    """
    import transformers.modeling_utils  # noqa: F401

    import probe_kernels  # noqa: F401
    from trainer.batch_losses import loss_for_kind  # in a function: `worker --help` loads no model code

    loss_for_kind("lm"), loss_for_kind("classifier")  # both probe losses' modules


def attention_dtype(option: str, device: str) -> torch.dtype | None:
    """The attention dtype of a worker's fp32 (TF32-kind) forwards for `--tf32-attention option` on `device`:
    torch.bfloat16 for "bf16", None (fp32) for "fp32"; "auto" is bf16 on CUDA (measured SNR: docs/RESULTS.md) and
    fp32 on CPU, where a worker's losses equal the trainer's bit for bit (trainer.zo.probes.forward_dtype's rule).
    Raises ValueError for any other option."""
    if option not in ("auto", "fp32", "bf16"):
        raise ValueError(f"tf32_attention must be auto, fp32 or bf16, got {option!r}")
    if option == "auto":
        option = "bf16" if torch.device(device).type == "cuda" else "fp32"
    return torch.bfloat16 if option == "bf16" else None


def chunk_check(drain: DrainState, device: str) -> Callable[[], None]:
    """The hook run before each perturbation, and each chunk of directions the CPU path generates
    (probe_kernels.reference.add_chunk_hook): a task stops once the engine fired it (its cut); the prefetch thread's
    replay stops while the engine is busy. On CUDA the task first waits for the work it queued (the previous forward),
    so a cut leaves at most one forward running on the device; this costs the probe loop its run-ahead (one
    host-device round trip per probe)."""

    def check() -> None:
        guard = drain.preemption
        if guard.in_task():
            if device.startswith("cuda"):
                torch.cuda.current_stream(torch.device(device)).synchronize()
            guard.check()
        elif drain.engine_busy and threading.current_thread().name == PREFETCH_THREAD:
            raise Preempted("the serving engine needs the device")

    return check


def replay_interrupt(drain: DrainState) -> Callable[[], None]:
    """Between two ledger entries of a replay (any thread: a task's or the prefetch's): stop while the serving
    engine is busy (WeightCache keeps the entries replayed so far)."""

    def interrupt() -> None:
        if drain.engine_busy:
            raise Preempted("the serving engine needs the device")

    return interrupt


def register_teacher(app: Celery, opts: WorkerOptions, reg: WorkerRegistered, client: CoordinatorClient,
                     drain: DrainState, runtime: ProbeRuntime) -> None:
    """Teacher rounds as a round kind of this worker (probe_worker.teacher): the `sparecycles.teacher` task of
    the coordinator's teacher queues (and --teacher-queue's), answered by the teacher loaded in this process
    (from the round's folder, else fetched from the coordinator's blobs) or, with `teacher_engine`, through
    that serving engine; handed back while the worker drains. The targets are written with this worker's
    broker credentials (its ACL user may write target keys, never read them: coordinator.broker_acl); the worker
    reads busy while it holds a round, as while it evaluates probes."""
    import redis

    # in a function: the teacher stack (fleet's teacher weights, transformers' tokenizers) loads only in a worker
    from fleet.teacher_weights import fetch_teacher
    from probe_worker.teacher import TeacherRuntime, default_teacher_metrics, register_teacher_task

    store = redis.Redis.from_url(reg.broker_url, socket_timeout=10, socket_connect_timeout=5)
    if opts.teacher_engine:
        from probe_worker.engine_teacher import EngineTeacher

        teacher = EngineTeacher(opts.teacher_engine, store)
    else:
        teacher = TeacherRuntime(opts.device, store, fetch=functools.partial(fetch_teacher, client),
                                 pause_s=opts.teacher_pause)
    register_teacher_task(app, teacher, default_teacher_metrics(), drain,
                          busy=lambda held: setattr(runtime, "busy", held))


def build_parts(opts: WorkerOptions) -> WorkerParts:
    """Register and build every part of a worker (see the module's docstring), in the order the worker always did.
    Raises what `register` raises."""
    host = socket.gethostname()[:64] or "unknown"
    name = opts.name or f"{host}-{opts.device}"
    metrics = default_metrics()
    client = CoordinatorClient(opts.coordinator)
    adopted, reenrolled = adopted_registration()
    metrics.reenrollments.inc(reenrolled)
    reg = register(opts, client, name, host, adopted)
    # Heartbeats get their own short-timeout, single-try client: a hung coordinator must not stall the
    # control loop (and with it local drains) behind the task path's long retries.
    hb_client = CoordinatorClient(opts.coordinator, client.token, attempts=1,
                                  timeout_s=max(1.0, min(5.0, reg.lease_seconds / 3)))
    app = broker_app(reg, opts.soft_shutdown)
    drain, stop = DrainState(), threading.Event()
    cache = WeightCache(client, opts.cache_dir, opts.device, keep_versions=opts.keep_versions,
                        keep_disk_versions=opts.keep_versions + 1, metrics=metrics, shared_blob_dir=opts.blob_dir)
    cache.stopping = lambda: stop.is_set() or shutting_down()  # a weight load stops between shards once stopping
    forwards = ForwardSettings(probe_path=opts.probe_path, cuda_graphs=opts.cuda_graphs,
                               attn_dtype=attention_dtype(opts.tf32_attention, opts.device),
                               segmented=opts.serving is not None)  # beside an engine: stop between blocks
    runtime = ProbeRuntime(client, reg.worker_id, cache, metrics, forwards=forwards)
    serving = None
    trace = TraceFile(opts.task_trace) if opts.task_trace else None
    if opts.serving is not None:
        serving = ServingWatch(opts.serving, drain, metrics, trace=trace)
        drain.set_engine_busy(True)  # until the engine reads idle for the hold time (EngineGate starts so)
        drain.preemption.install()
        cache.interrupt = replay_interrupt(drain)  # a ledger replay stops between entries while the engine is busy
        cache.interruptible = True  # ... and inside one, at a chunk of directions (chunk_check)
        add_chunk_hook(chunk_check(drain, opts.device))
    register_probe_task(app, runtime, drain, metrics, trace)
    register_teacher(app, opts, reg, client, drain, runtime)
    warm_up()
    gpu_util = gpu_utilization_reader(opts.device) if opts.yield_gpu_util else None
    return WorkerParts(opts=opts, host=host, name=name, metrics=metrics, reg=reg, reenrolled=reenrolled,
                       client=client, hb_client=hb_client, app=app, drain=drain, stop=stop, cache=cache,
                       runtime=runtime, serving=serving, gpu_util=gpu_util)
