"""Teacher rounds from the trainer's side (issue 36): a window of steps ahead sent to teacher workers
(probe_worker/teacher.py) and their target blobs taken at intake: a targets source of
trainer.kd.sparse_loss.SparseKDLoss, the loss_fn that uses them.

The trainer's batches are a pure function of the step (trainer.tasks.Task.batch), so the window sends the
batches of steps [s, s + window) before the trainer reaches them; each answer lands in Redis under
wire.teacher_messages.target_key(run, rank, recipe, batch_key(x)). A step whose targets have not arrived trains on CE
alone and is counted in `sparecycles_trainer_kd_missing_steps` (a rejected blob also: trainer.kd.intake counts
it in `..._kd_rejected`); `strict=True` waits for them up to `strict_timeout_s`, then counts the step missing.
Each blob is read with GETDEL: taken once, so a redelivered answer is never counted twice.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import uuid
from collections.abc import Callable

import redis
import torch
from celery import Celery
from kombu.exceptions import OperationalError
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, stop_when_event_set, wait_fixed

from fleet.teacher_weights import publish_teacher
from trainer.console import STOP_REQUESTED
from trainer.kd.sparse_loss import SparseKDLoss, intake_step, whole_batches
from trainer.kd.teacher import ENGINE_PROBE_TEXTS, batch_key, teacher_folder, teacher_sha256
from trainer.ledger import phase
from trainer.metrics import KD_AHEAD, KD_MISSING, KD_REJECTED
from wire.kd_targets import KDTargets
from wire.teacher_messages import (
    ROUND_TTL_S,
    TEACHER_QUEUE_PREFIX,
    TEACHER_TASK_NAME,
    StudentTokenizer,
    TeacherTask,
    recipe_tag,
    target_key,
)

log = logging.getLogger("sparecycles.teacher")

# What a full (maxmemory) or lost broker/store raises while rounds are sent or answers read: never fatal to a run.
STORE_ERRORS = (redis.RedisError, OperationalError)


def teacher_queue(run: str) -> str:
    """The Celery queue of `run`'s teacher rounds."""
    return f"{TEACHER_QUEUE_PREFIX}.{run}"


def engine_fields(student: str | None, teacher: str) -> tuple[StudentTokenizer | None, int | None]:
    """The rounds' student_tokenizer (the student's ids of ENGINE_PROBE_TEXTS, trainer.data.model_tokenizer) and
    teacher_vocab (the teacher folder's config.json vocab_size): (None, None) without a student. Raises
    TokenizerError for a student without a tokenizer, ValueError for a config without an int vocab_size."""
    if student is None:
        return None, None
    from trainer.data.model_tokenizer import tokenizer_for

    tok = tokenizer_for(student)
    vocab = json.loads((teacher_folder(teacher) / "config.json").read_text()).get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"teacher {teacher}: config.json has no integer vocab_size ({vocab!r})")
    return StudentTokenizer(name=tok.name, ids=tok.encode_batch(list(ENGINE_PROBE_TEXTS))), vocab


class TeacherTimeout(ConnectionError):
    """--kd-strict waited `strict_timeout_s` for a step's targets and none came: no teacher worker answers the
    run's queue. A ConnectionError, so trainer.train checkpoints the position reached and says to --resume."""


class FleetTeacher:
    """The window of teacher rounds ahead of one rank's trainer.

    batch_fn(step) -> (x, y), x int64 (B, T): the trainer's own batches. `run` names the answers' keys (and the
    metrics' label): two runs on one store must not share it, or one takes the other's answers. `queue` (default
    teacher_queue(run)) is where the rounds go; many runs may share one. `advance(step)` sends the rounds of
    steps [step, step + window) not yet sent; `take(x, vocab)` -> KDTargets or None (missing or rejected, counted).
    Built, it publishes the teacher's weights into the store once (fleet.teacher_weights.publish_teacher) for
    workers that cannot read its folder. Raises ValueError for window < 1 or strict_timeout_s <= 0. Network calls
    carry the Redis client's timeouts.
    """

    def __init__(self, app: Celery, store: redis.Redis, *, run: str, teacher: str, batch_fn: Callable,
                 kind: str, k: int, temperature: float, seed: int, rank: int = 0, window: int = 8,
                 strict: bool = False, strict_timeout_s: float = 120.0, steps: int | None = None,
                 queue: str | None = None, student: str | None = None, round_ttl_s: float = ROUND_TTL_S) -> None:
        if window < 1 or not strict_timeout_s > 0:
            raise ValueError(f"teacher window {window} (>= 1) and strict timeout {strict_timeout_s} s (> 0)")
        self.app, self.store, self.run, self.batch_fn = app, store, run, batch_fn
        self.queue = queue or teacher_queue(run)  # where the rounds go; `run` names their answers' keys
        self.teacher_dir, self.sha = str(teacher_folder(teacher)), teacher_sha256(teacher)
        self.kind, self.k, self.temperature, self.seed, self.rank = kind, k, temperature, seed, rank
        self.window, self.strict, self.strict_timeout_s = window, strict, strict_timeout_s
        self.round_ttl_s = round_ttl_s  # seconds a round may wait in its queue (Celery `expires`)
        self.recipe = recipe_tag(kind, k, temperature, seed)
        self.steps = steps  # the run's length: no round is sent for a step at or past it (None: no end)
        self.sent: dict[int, int] = {}  # batch key -> step, for steps sent and not yet taken
        self.refused: dict[int, int] = {}  # batch key -> step, for steps whose round the broker refused
        self.next_step = 0
        self.missing = self.taken = self.send_errors = 0
        self.bytes_up = self.bytes_down = 0
        for counter in (KD_MISSING, KD_REJECTED):  # the run's series exist (at 0) before any step is missed
            counter.labels(run)
        self.published_bytes = self._publish(teacher)
        # what a worker answering through a serving engine checks and writes (probe_worker.engine_teacher)
        self.student_tokenizer, self.teacher_vocab = engine_fields(student, teacher)

    def _publish(self, teacher: str) -> int:
        """Publish the teacher's weights into the store once (fleet.teacher_weights), so a worker on a machine
        that cannot read teacher_dir fetches them; bytes written (0: already there). A store that refuses them
        (maxmemory) is warned about, not fatal: workers that read the folder still answer."""
        try:
            manifest, written = publish_teacher(self.store, teacher)
        except redis.RedisError as exc:
            log.warning("teacher %s not published in the store (%s): only workers that can read %s answer",
                        self.sha[:12], str(exc)[:200], self.teacher_dir)
            return 0
        if written:
            log.info("teacher %s published in the store: %d files, %d bytes", self.sha[:12], len(manifest.files),
                     written)
        return written

    def task_for(self, step: int) -> TeacherTask:
        """The teacher round of `step`: its batch's ids, the teacher and the target recipe."""
        x = self.batch_fn(step)[0]
        ids = x.detach().cpu().numpy().astype("<u4")
        return TeacherTask(run=self.run, teacher_dir=self.teacher_dir, teacher_sha256=self.sha, rank=self.rank,
                           step=step, key=batch_key(x), batch=int(x.shape[0]), seq_len=int(x.shape[1]),
                           ids_b64=base64.b64encode(ids.tobytes()).decode(), kind=self.kind, k=self.k,
                           temperature=self.temperature, seed=self.seed, student_tokenizer=self.student_tokenizer,
                           teacher_vocab=self.teacher_vocab)

    def advance(self, step: int) -> int:
        """Send the rounds of steps [max(step, next unsent), step + window); returns how many were sent.

        A broker or store that refuses (full: maxmemory; down) never stops the trainer: the rounds it refused are
        not sent again (a late round would come after its step), their steps train on CE alone (counted missing),
        and each refusal is counted in stats()["kd_send_errors"] and logged (the first, then every 100th)."""
        start, stop = max(step, self.next_step), step + self.window
        if self.steps is not None:
            stop = min(stop, self.steps)
        pending = start  # the first step not sent yet
        try:
            with self.app.producer_or_acquire() as producer:
                for s in range(start, stop):
                    task = self.task_for(s)
                    self.app.send_task(TEACHER_TASK_NAME, kwargs=task.model_dump(mode="json"),
                                       queue=self.queue, producer=producer, ignore_result=True,
                                       expires=self.round_ttl_s)
                    self.sent[task.key] = s
                    self.bytes_up += len(task.ids_b64)
                    pending = s + 1
            pipe = self.store.pipeline(transaction=False)  # one round trip for the whole window
            for key in self.sent:
                pipe.exists(target_key(self.run, self.rank, self.recipe, key))
            KD_AHEAD.labels(self.run).set(sum(int(n) for n in pipe.execute()))
        except STORE_ERRORS as exc:
            self._store_error("sending teacher rounds", exc)
            for s in range(pending, stop):  # their steps: missing at once, named, never waited for (strict too)
                self.refused[batch_key(self.batch_fn(s)[0])] = s
        self.next_step = max(self.next_step, stop)
        return pending - start

    def _store_error(self, doing: str, exc: Exception) -> None:
        """Count a refusal of the broker or store (stats' kd_send_errors) and log the first and every 100th."""
        self.send_errors += 1
        if self.send_errors % 100 == 1:
            log.warning("%s on %s failed (%s: %s; %d so far): the steps without targets train on CE alone",
                        doing, self.queue, type(exc).__name__, str(exc)[:200], self.send_errors)

    def _get(self, key: int) -> bytes | None:
        """The answer of batch `key`, taken (GETDEL); None when not there or the store refuses (counted)."""
        try:
            return self.store.getdel(target_key(self.run, self.rank, self.recipe, key))
        except redis.RedisError as exc:
            self._store_error("reading teacher targets", exc)
            return None

    def seek(self, step: int) -> None:
        """Start the window at 0-based `step` (0, or a resume's checkpointed step); sends its rounds."""
        self.next_step = step
        self.advance(step)

    def stats(self) -> dict[str, int]:
        """{kd_taken_steps, kd_missing_steps, kd_bytes_up, kd_bytes_down, kd_send_errors}: the run's counts so far
        (bytes over the wire: batch ids sent as base64, target blobs taken; refusals of the broker or store)."""
        return {"kd_taken_steps": self.taken, "kd_missing_steps": self.missing, "kd_bytes_up": self.bytes_up,
                "kd_bytes_down": self.bytes_down, "kd_send_errors": self.send_errors}

    def take(self, x: torch.Tensor, vocab: int) -> KDTargets | None:
        """The targets of batch x (B, T) int64 for a student of `vocab` ids, taken once; None when missing or
        rejected (counted, and reported through trainer.health as teacher_missing). Advances the window."""
        with phase("kd"):  # the ledger's kd phase: reading (strict: waiting for) targets, sending the window
            return self._take(x, vocab)

    def _timeout(self, step: int) -> TeacherTimeout:
        """The error of a --kd-strict wait for `step`'s targets that ran out."""
        return TeacherTimeout(
            f"--kd-strict: no teacher targets for step {step} in {self.strict_timeout_s:.0f} s on queue "
            f"{self.queue}: is a teacher worker consuming it (python -m probe_worker.teacher "
            f"--broker URL --queue {self.queue}), and can it load teacher {self.sha[:12]} (a worker that "
            "can neither read its folder nor fetch it from the store refuses the round: see its log)?")

    def _take(self, x: torch.Tensor, vocab: int) -> KDTargets | None:
        key = batch_key(x)
        step, refused = self.sent.pop(key, None), self.refused.pop(key, None)
        blob = self._get(key) if refused is None else None
        if blob is None and self.strict and step is not None:  # wait only for a round that was sent
            try:
                blob = Retrying(stop=stop_after_delay(self.strict_timeout_s) | stop_when_event_set(STOP_REQUESTED),
                                wait=wait_fixed(0.05), retry=retry_if_result(lambda b: b is None))(self._get, key)
            except RetryError:
                if STOP_REQUESTED.is_set():  # Ctrl-C / SIGTERM: the step goes on without them, then the run stops
                    print(f"stopping: not waiting for the teacher's targets of step {step + 1}; it trains on CE "
                          "alone, then the run checkpoints", file=sys.stderr, flush=True)
                    blob = None
                else:
                    raise self._timeout(step) from None
        step = refused if refused is not None else step
        self.advance((step if step is not None else self.next_step - self.window) + 1)
        if refused is not None:
            why = "its round was refused by the broker"
        elif step is not None:
            why = "not arrived from the fleet" if not STOP_REQUESTED.is_set() else "the run is stopping (not waited for)"
        else:
            why = "no round was sent for this batch (not one of the window's steps)"
        self.bytes_down += len(blob) if blob is not None else 0
        targets = intake_step(blob, x, vocab, run=self.run, step=step, why=why)
        self.taken, self.missing = self.taken + (targets is not None), self.missing + (targets is None)
        return targets


def kd_loss_factory(redis_url: str, *, window: int = 8, strict: bool = False, strict_timeout_s: float = 120.0,
                    run: str | None = None) -> Callable:
    """trainer.train's `kd_loss_factory`: (cfg, task, rank, batch_fn=None) -> SparseKDLoss over the teacher rounds of
    `batch_fn(step)`'s batches (this rank's, under torchrun; default task.batch) sent by a
    FleetTeacher on `redis_url` (its Celery broker and target store) for the run named `run` (default: kd-, the
    teacher's sha256 prefix and the seed, so a resumed run finds its queue; the answers' keys add a per-process
    id). Raises ValueError for a non-redis URL or a Redis that does not answer a PING (5 s), and (when built) for
    --kd-estimator full: the fleet sends sparse targets only."""
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"teacher rounds need a redis:// URL, got {redis_url!r}")
    try:  # before the run starts: one line, not a Celery traceback at the first round
        redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        where = redis_url.split("://", 1)[1].rsplit("@", 1)[-1]  # host:port/db, never a password
        raise ValueError(f"the Redis at {where} does not answer ({exc})") from None
    from coordinator.celery_app import make_celery

    def build(cfg, task, rank: int, batch_fn: Callable | None = None) -> SparseKDLoss:
        if cfg.kd_estimator == "full":
            raise ValueError("teacher rounds on the fleet send sparse targets: --kd-estimator sampled or topk")
        name = run or f"kd-{teacher_sha256(cfg.teacher)[:12]}-{cfg.seed}"
        batch_fn = batch_fn or task.batch  # the rank's batch as trained: (x, y), or MicroBatches
        store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        # The queue is the run's name, which teacher workers are started on; the answers' keys also carry this
        # process's own id: two runs of one teacher and seed on one store (a sweep over alpha) each take their own.
        keys = f"{name[:55]}-{uuid.uuid4().hex[:8]}"
        if rank == 0:  # the one line a user needs to start a teacher worker on the right queue
            print(f"teacher rounds on queue {teacher_queue(name)} (python -m probe_worker.teacher --queue "
                  f"{teacher_queue(name)} answers them)", file=sys.stderr, flush=True)
        fleet = FleetTeacher(make_celery(redis_url), store, run=keys, queue=teacher_queue(name), teacher=cfg.teacher,
                             batch_fn=whole_batches(batch_fn),
                             kind=cfg.kd_estimator, k=cfg.kd_k, temperature=cfg.kd_temperature, seed=cfg.seed,
                             rank=rank, window=window, strict=strict, strict_timeout_s=strict_timeout_s,
                             steps=cfg.steps, student=cfg.model)
        return SparseKDLoss(fleet, alpha=cfg.kd_alpha, batch_fn=batch_fn)  # one round per step, rows per call

    return build
