"""Teacher rounds, a round kind of `sparecycles worker`: the Celery task `sparecycles.teacher` (a
wire.teacher_messages.TeacherTask in, a wire.kd_targets blob out under its Redis key), registered by
probe_worker.worker on the enrolled worker's Celery app, its queues the coordinator's teacher queues.

The teacher is loaded once per sha256 (trainer.kd.teacher.load_teacher: bf16 on CUDA, compiled; fp32 on CPU)
from the task's folder when this machine can read it with the task's sha256, else from the coordinator's blobs
(fleet.teacher_weights.fetch_teacher: the teacher its trainer registered, fetched once, verified, kept under
$SPARECYCLES_CACHE/teachers), as weight versions are fetched.
Targets are trainer.kd.targets.make_targets of the teacher's logits, seeded by (seed, key, rank) as the in-process KDLoss seeds them. Delivery: late ack and
reject-on-worker-lost (coordinator.celery_app), so a killed worker's task is redelivered; the answer is a
SET NX, so a redelivered task writes nothing twice. Outcomes, counted in
`sparecycles_worker_teacher_tasks_total{outcome}`: done, duplicate (the key was already answered),
invalid (not a TeacherTask, or ids outside the teacher's vocabulary: rejected without requeue),
refused (neither the folder nor the store gives the task's teacher), engine_invalid / engine_error (an engine
teacher's engine answered what is not targets / did not answer: probe_worker.engine_teacher), expired (queued
past its `expires`, wire.teacher_messages.ROUND_TTL_S: dropped unanswered, its step long trained), requeued (the worker began shutting down
inside the round: Celery's cold shutdown of the solo pool raises into the running task; the round goes back to the
queue for the next worker; also a round taken while the worker drains: SIGUSR1, the coordinator's drain, the
serving engine's turn), error (anything else; the worker lives on).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from celery import Celery, Task
from celery.exceptions import Reject
from celery.signals import task_revoked
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

from fleet.teacher_weights import TeacherUnavailable
from probe_kernels import FastForward, lm_logits
from probe_worker.tasks import (
    REQUEUE_PAUSE_S,
    DrainState,
    HandBack,
    log_hand_back,
    quiet_hand_backs,
    shutting_down,
)
from probe_worker.teacher_outcomes import TeacherRefused, TeacherUnanswered
from trainer.kd.targets import make_targets
from trainer.kd.teacher import TeacherMismatchError, load_teacher, teacher_sha256
from trainer.paths import cache_dir
from wire.kd_targets import encode
from wire.teacher_messages import TARGET_TTL_S, TEACHER_TASK_NAME, TeacherTask, target_key

log = logging.getLogger("sparecycles.worker.teacher")
Fetch = Callable[[str, Path], tuple[Path, int]]  # (teacher sha256, root) -> (its folder, bytes fetched)


class TeacherMetrics:
    """The teacher worker's metrics: tasks by outcome, tokens/s of the last batch, target bytes written."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.tasks = Counter("sparecycles_worker_teacher_tasks_total", "Teacher rounds handled, by outcome",
                             ["outcome"], registry=registry)
        self.tokens_per_s = Gauge("sparecycles_worker_teacher_tokens_per_second", "Teacher forward + targets "
                                  "of the last batch (tokens/s, this worker)", registry=registry)
        self.bytes = Counter("sparecycles_worker_teacher_target_bytes_total", "Target blob bytes written",
                             registry=registry)
        self.fetched = Counter("sparecycles_worker_teacher_fetched_bytes_total", "Teacher weight bytes fetched "
                               "from the store (a teacher published by its trainer, its folder not readable here)",
                               registry=registry)


@functools.cache
def default_teacher_metrics() -> TeacherMetrics:
    """The process-wide TeacherMetrics on the default registry (the one the worker's metrics port serves)."""
    return TeacherMetrics()


class TeacherRuntime:
    """One loaded teacher on `device` and the Redis client its answers go to.

    `answer(task)` -> outcome name; raises ValueError for ids outside the teacher's vocabulary and
    TeacherRefused when neither the task's folder (read here, its sha256 the task's) nor `fetch(sha, root)` (the
    coordinator's blobs: fleet.teacher_weights.fetch_teacher with the worker's client; root default
    $SPARECYCLES_CACHE/teachers; None: folders only) gives the teacher.
    """

    def __init__(self, device: str, store: redis.Redis, fetch: Fetch | None = None, pause_s: float = 0.0,
                 root: Path | None = None) -> None:
        self.device, self.store, self.pause_s, self.fetch = device, store, pause_s, fetch
        self.root = root if root is not None else cache_dir() / "teachers"  # fetched teachers (fetch_teacher)
        self.fetched_bytes = 0  # of the last teacher fetched from the store (0: read from its folder or cached)
        self.sha: str | None = None
        self.model: torch.nn.Module | None = None
        self.vocab = 0
        self.last_tokens_per_s, self.last_bytes = 0.0, 0  # of the last round answered (tokens/s; blob bytes written)
        self.forward: Any = None

    def _folder(self, task: TeacherTask) -> Path:
        """The round's teacher folder: task.teacher_dir when readable here with the round's sha256, else the
        coordinator's blobs of it (fleet.teacher_weights), fetched once into `root`."""
        try:
            found = teacher_sha256(task.teacher_dir)
            if found == task.teacher_sha256:
                return Path(task.teacher_dir)
            why = f"teacher folder {task.teacher_dir} has sha256 {found[:12]}, the round names {task.teacher_sha256[:12]}"
        except (TeacherMismatchError, OSError) as exc:
            why = f"teacher folder {task.teacher_dir} is not readable here ({str(exc)[:160]})"
        if self.fetch is None:
            raise TeacherRefused(f"{why}, and this worker has no coordinator to fetch it from")
        try:
            folder, self.fetched_bytes = self.fetch(task.teacher_sha256, self.root)
        except TeacherUnavailable as exc:
            raise TeacherRefused(f"{why}, and {exc}") from None
        if self.fetched_bytes:
            log.info("teacher %s fetched from the coordinator into %s (%d bytes): %s", task.teacher_sha256[:12], folder,
                     self.fetched_bytes, why)
        else:
            log.info("teacher %s read from this worker's copy %s (fetched before): %s", task.teacher_sha256[:12],
                     folder, why)
        return folder

    def _load(self, task: TeacherTask) -> None:
        if self.sha == task.teacher_sha256:
            return
        model = load_teacher(str(self._folder(task)), self.device)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        # the fast path's shared forward (compiled on CUDA; on CPU the model's own code, bit for bit)
        self.forward = FastForward(model, lm_logits)
        self.model = self.forward.shadow  # FastForward's private copy: the loaded model itself is not kept
        self.sha = task.teacher_sha256
        log.info("teacher %s loaded on %s", task.teacher_sha256[:12], self.device)

    def answer(self, task: TeacherTask) -> str:
        """Compute and store the targets of one batch; 'duplicate' when its key is already answered."""
        key = target_key(task.run, task.rank, task.recipe, task.key)
        if self.store.exists(key):
            return "duplicate"
        self._load(task)
        time.sleep(self.pause_s)  # 0 unless --pause-s: holds a round so a redelivery test can kill the worker
        ids = np.frombuffer(task.ids_raw(), dtype="<u4").astype(np.int64).reshape(task.batch, task.seq_len)
        if int(ids.max()) >= self.vocab:
            raise ValueError(f"token id {int(ids.max())} outside the teacher's vocabulary of {self.vocab}")
        t0 = time.perf_counter()
        with torch.no_grad():
            z = self.forward(torch.from_numpy(ids).to(self.device))
        targets = make_targets(z, kind=task.kind, k=task.k, temperature=task.temperature, seed=task.seed,
                               step=task.key, rank=task.rank)
        blob = encode(targets)
        self.last_tokens_per_s = ids.size / (time.perf_counter() - t0)
        written = self.store.set(key, blob, nx=True, ex=TARGET_TTL_S)
        self.last_bytes = len(blob) if written else 0
        return "done" if written else "duplicate"


def run_teacher(runtime: TeacherRuntime, metrics: TeacherMetrics, kwargs: Any, drain: DrainState | None = None) -> str:
    """Handle one delivery of a teacher task; returns the outcome (module docstring). Raises Reject without
    requeue for an invalid task; HandBack (a Reject with requeue, logged by the caller as one line, as a probe task's)
    while `drain` says the worker drains or when the worker stops mid-round; every other failure is logged and
    counted, never raised."""
    def outcome(name: str) -> str:
        metrics.tasks.labels(name).inc()
        return name

    try:
        task = TeacherTask.model_validate(kwargs)
    except (ValidationError, ValueError, TypeError) as exc:
        outcome("invalid")
        log.warning("rejected an invalid teacher task: %s", str(exc)[:300])
        raise Reject(f"invalid teacher task: {str(exc)[:200]}", requeue=False) from None
    if drain is not None and not drain.taking_tasks:
        outcome("requeued")
        time.sleep(REQUEUE_PAUSE_S)
        raise HandBack(f"teacher round {task.run} step {task.step}: not taking tasks ({', '.join(drain.reasons())})")
    try:
        name = runtime.answer(task)
    except ValueError as exc:
        outcome("invalid")
        log.warning("rejected teacher round %s/%d step %d: %s", task.run, task.rank, task.step, exc)
        raise Reject(str(exc)[:200], requeue=False) from None
    except TeacherRefused as exc:
        log.warning("%s", exc)
        return outcome("refused")
    except TeacherUnanswered as exc:
        log.warning("teacher round %s step %d unanswered: %s", task.run, task.step, exc)
        return outcome(exc.outcome)
    except Exception as exc:
        if shutting_down():  # whatever a shutdown signal raised in here, the round is not done: not acked as one
            outcome("requeued")
            raise HandBack(f"teacher round {task.run} step {task.step}: the worker stops ({type(exc).__name__})",
                           logging.WARNING) from None
        log.exception("teacher round %s step %d failed", task.run, task.step)
        return outcome("error")
    finally:
        metrics.fetched.inc(runtime.fetched_bytes)  # a fetch is counted whatever became of the round
        runtime.fetched_bytes = 0
    if name == "done":
        metrics.tokens_per_s.set(runtime.last_tokens_per_s)
        metrics.bytes.inc(runtime.last_bytes)
    return outcome(name)


def register_teacher_task(app: Celery, runtime: TeacherRuntime, metrics: TeacherMetrics,
                          drain: DrainState | None = None, busy: Callable[[bool], None] | None = None) -> Task:
    """Register `sparecycles.teacher` on `app` (JSON, acks_late, reject_on_worker_lost, no result); a round taken
    while `drain` says the worker drains goes back to its queue. `busy(True)` / `busy(False)` around each round
    (the worker's heartbeat `busy`, which its GPU-yield policy also reads: its own rounds are not another load).
    A hand-back is logged as one line, without Celery's traceback (probe_worker.tasks.log_hand_back)."""
    quiet_hand_backs()

    @app.task(name=TEACHER_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
              serializer="json", typing=False)
    def teacher(self: Task, **kwargs: Any) -> str:
        if busy is not None:
            busy(True)
        try:
            return run_teacher(runtime, metrics, kwargs, drain)
        except HandBack as exc:
            log_hand_back("teacher", self.request.id, exc)
            raise
        finally:
            if busy is not None:
                busy(False)

    def expired(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
        if expired and getattr(request, "name", None) == TEACHER_TASK_NAME:
            metrics.tasks.labels("expired").inc()  # queued past its expiry (fleet.teacher's round_ttl_s): dropped

    task_revoked.connect(expired, weak=False)
    return teacher
