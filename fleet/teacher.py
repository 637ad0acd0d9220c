"""Teacher rounds from the trainer's side: a window of steps ahead sent to the workers' teacher round
kind (probe_worker/teacher.py, on `sparecycles worker`) and their target blobs taken at intake: a targets source of
trainer.kd.sparse_loss.SparseKDLoss, the loss_fn that uses them.

The trainer's batches are a pure function of the step (trainer.tasks.Task.batch), so the window sends the
batches of steps [s, s + window) before the trainer reaches them; each answer lands in Redis under
wire.teacher_messages.target_key(run, rank, recipe, batch_key(x)). A step whose targets have not arrived trains on CE
alone and is counted in `sparecycles_trainer_kd_missing_steps` (a rejected blob also: trainer.kd.intake counts
it in `..._kd_rejected`); `strict=True` waits for them up to `strict_timeout_s`, then counts the step missing.
Each blob is read with GETDEL: taken once, so a redelivered answer is never counted twice. The workers learn of the
queue, and fetch a teacher whose folder they cannot read, from the coordinator the run registered it at
(fleet.teacher_weights.publish_teacher: `sparecycles up` does so for its runs); a worker started with
`--teacher-queue` consumes it without one.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import torch
from celery import Celery
from kombu.exceptions import OperationalError
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, stop_when_event_set, wait_fixed

from coordinator.celery_app import make_celery
from trainer.console import STOP_REQUESTED
from trainer.data.model_tokenizer import tokenizer_for
from trainer.kd.sparse_loss import SparseKDLoss, intake_step, whole_batches
from trainer.kd.teacher import ENGINE_PROBE_TEXTS, batch_key, teacher_folder, teacher_sha256
from trainer.ledger import phase
from trainer.metrics import KD_AHEAD, KD_MISSING, KD_REJECTED
from wire.kd_targets import KDTargets
from wire.teacher_messages import (
    ROUND_TTL_S,
    TEACHER_TASK_NAME,
    StudentTokenizer,
    TeacherTask,
    recipe_tag,
    target_key,
    teacher_queue,
)

log = logging.getLogger("sparecycles.teacher")

# What a full (maxmemory) or lost broker/store raises while rounds are sent or answers read: never fatal to a run.
STORE_ERRORS = (redis.RedisError, OperationalError)


__all__ = ["FleetTeacher", "RoundFlow", "TeacherRecipe", "TeacherTimeout", "engine_fields", "kd_loss_factory",
           "teacher_queue"]


def engine_fields(student: str | None, teacher: str) -> tuple[StudentTokenizer | None, int | None]:
    """The rounds' student_tokenizer (the student's ids of ENGINE_PROBE_TEXTS, trainer.data.model_tokenizer) and
    teacher_vocab (the teacher folder's config.json vocab_size): (None, None) without a student. Raises
    TokenizerError for a student without a tokenizer, ValueError for a config without an int vocab_size."""
    if student is None:
        return None, None
    tok = tokenizer_for(student)
    vocab = json.loads((teacher_folder(teacher) / "config.json").read_text()).get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"teacher {teacher}: config.json has no integer vocab_size ({vocab!r})")
    return StudentTokenizer(name=tok.name, ids=tok.encode_batch(list(ENGINE_PROBE_TEXTS))), vocab


class TeacherTimeout(ConnectionError):
    """--kd-strict waited `strict_timeout_s` for a step's targets and none came: no teacher worker answers the
    run's queue. A ConnectionError, so trainer.train checkpoints the position reached and says to --resume."""


@dataclass(frozen=True)
class TeacherRecipe:
    """What every round asks for: the teacher (a preset or a transformers folder), the target kind (sampled or
    topk), ids per position, temperature and seed; `student` (its folder) makes the rounds carry its tokenizer's
    probe ids for a worker that asks a serving engine (None: none sent)."""

    teacher: str
    kind: str
    k: int
    temperature: float
    seed: int
    student: str | None = None

    @classmethod
    def of(cls, cfg: Any) -> TeacherRecipe:
        """The recipe of run settings `cfg` (trainer.config.TrainConfig: teacher, kd_estimator, kd_k, ...)."""
        return cls(cfg.teacher, cfg.kd_estimator, cfg.kd_k, cfg.kd_temperature, cfg.seed, cfg.model)


@dataclass(frozen=True)
class RoundFlow:
    """How the rounds flow: `window` steps ahead (>= 1); `strict`: a step waits up to `strict_timeout_s` seconds
    (> 0) for its targets; a round waits at most `round_ttl_s` seconds in its queue (Celery `expires`)."""

    window: int = 8
    strict: bool = False
    strict_timeout_s: float = 120.0
    round_ttl_s: float = ROUND_TTL_S


class FleetTeacher:
    """The window of teacher rounds ahead of one rank's trainer.

    batch_fn(step) -> (x, y), x int64 (B, T): the trainer's own batches. `run` names the answers' keys (and the
    metrics' label): two runs on one store must not share it, or one takes the other's answers. `teacher`: what the
    rounds ask; `flow`: how they flow. `queue` (default teacher_queue(run)) is where the rounds go; many runs may
    share one. `steps`: the run's length (no round past it; None: no end). `advance(step)` sends the rounds of
    steps [step, step + window) not yet sent; `take(x, vocab)` -> KDTargets or None (missing or rejected, counted).
    Raises ValueError for window < 1 or strict_timeout_s <= 0. Network calls carry the Redis client's timeouts.
    """

    def __init__(self, app: Celery, store: redis.Redis, *, run: str, teacher: TeacherRecipe, batch_fn: Callable,
                 flow: RoundFlow | None = None, rank: int = 0, steps: int | None = None,
                 queue: str | None = None) -> None:
        flow = flow or RoundFlow()
        if flow.window < 1 or not flow.strict_timeout_s > 0:
            raise ValueError(f"teacher window {flow.window} (>= 1) and strict timeout {flow.strict_timeout_s} s (> 0)")
        self.app, self.store, self.run, self.batch_fn = app, store, run, batch_fn
        self.queue = queue or teacher_queue(run)  # where the rounds go; `run` names their answers' keys
        self.teacher_dir, self.sha = str(teacher_folder(teacher.teacher)), teacher_sha256(teacher.teacher)
        self.kind, self.k, self.temperature, self.seed = teacher.kind, teacher.k, teacher.temperature, teacher.seed
        self.rank = rank
        self.window, self.strict, self.strict_timeout_s = flow.window, flow.strict, flow.strict_timeout_s
        self.round_ttl_s = flow.round_ttl_s  # seconds a round may wait in its queue (Celery `expires`)
        self.recipe = recipe_tag(teacher.kind, teacher.k, teacher.temperature, teacher.seed)
        self.steps = steps  # the run's length: no round is sent for a step at or past it (None: no end)
        self.sent: dict[int, int] = {}  # batch key -> step, for steps sent and not yet taken
        self.refused: dict[int, int] = {}  # batch key -> step, for steps whose round the broker refused
        self.next_step = 0
        self.missing = self.taken = self.send_errors = 0
        self.bytes_up = self.bytes_down = 0
        for counter in (KD_MISSING, KD_REJECTED):  # the run's series exist (at 0) before any step is missed
            counter.labels(run)
        # what a worker answering through a serving engine checks and writes (probe_worker.engine_teacher)
        self.student_tokenizer, self.teacher_vocab = engine_fields(teacher.student, teacher.teacher)
        self.on_end: Callable[[], Any] | None = None  # kd_loss_factory's `end`: run once by close()

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

    def close(self) -> None:
        """The run is over (finished, failed or interrupted): run `on_end` once (kd_loss_factory's `end`: the
        teacher run ended at its coordinator, as the probe backend ends the probe run). Best effort: a failure is
        logged, never raised (the run's own outcome stands; a resume registers the teacher run again)."""
        on_end, self.on_end = self.on_end, None
        if on_end is None:
            return
        try:
            on_end()
        except Exception as exc:  # noqa: BLE001 - workers then consume an empty queue until the coordinator restarts
            log.warning("could not end teacher queue %s: %s: %s", self.queue, type(exc).__name__, str(exc)[:200])

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
            f"{self.queue}: is a worker consuming it (`sparecycles worker` of a coordinator the run's teacher is "
            f"registered at, or with --teacher-queue {self.queue}), and can it load teacher {self.sha[:12]} (a "
            "worker that can neither read its folder nor fetch it from the coordinator refuses the round: see its "
            "log)?")

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
                    run: str | None = None, register: Callable[[str, str], Any] | None = None,
                    end: Callable[[str], Any] | None = None) -> Callable:
    """trainer.train's `kd_loss_factory`: (cfg, task, rank, batch_fn=None) -> SparseKDLoss over the teacher rounds of
    `batch_fn(step)`'s batches (this rank's, under torchrun; default task.batch) sent by a
    FleetTeacher on `redis_url` (its Celery broker and target store) for the run named `run` (default: kd-, the
    teacher's sha256 prefix and the seed, so a resumed run finds its queue; the answers' keys add a per-process
    id). `register(teacher, run)`, when given, is called once by rank 0 before the first round, with the run's name
    (`train --coordinator`: the teacher run registered at the coordinator, so its enrolled workers consume the
    queue, as `up --teacher` registers its runs). `end(run)`, when given, is called by rank 0 when the loss is
    closed at the run's end (SparseKDLoss.close, also after a failure or Ctrl-C): the teacher run ended there, so
    the workers stop consuming its queue, as the probe run's queue is taken off their list. Raises ValueError for a non-redis URL or a Redis that does not answer a PING (5 s), and (when built) for
    --kd-estimator full: the fleet sends sparse targets only."""
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"teacher rounds need a redis:// URL, got {redis_url!r}")
    try:  # before the run starts: one line, not a Celery traceback at the first round
        redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        where = redis_url.split("://", 1)[1].rsplit("@", 1)[-1]  # host:port/db, never a password
        raise ValueError(f"the Redis at {where} does not answer ({exc})") from None
    def build(cfg, task, rank: int, batch_fn: Callable | None = None) -> SparseKDLoss:
        if cfg.kd_estimator == "full":
            raise ValueError("teacher rounds on the fleet send sparse targets: --kd-estimator sampled or topk")
        name = run or f"kd-{teacher_sha256(cfg.teacher)[:12]}-{cfg.seed}"
        batch_fn = batch_fn or task.batch  # the rank's batch as trained: (x, y), or MicroBatches
        store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        # The queue is the run's name, which teacher workers are started on; the answers' keys also carry this
        # process's own id: two runs of one teacher and seed on one store (a sweep over alpha) each take their own.
        keys = f"{name[:55]}-{uuid.uuid4().hex[:8]}"
        if rank == 0 and register is not None:  # the coordinator tells its enrolled workers the queue
            register(cfg.teacher, name)
        elif rank == 0:  # the one line a user needs to start a teacher worker on the right queue
            print(f"teacher rounds on queue {teacher_queue(name)} (`sparecycles worker --teacher-queue "
                  f"{teacher_queue(name)}` answers them)", file=sys.stderr, flush=True)
        fleet = FleetTeacher(make_celery(redis_url), store, run=keys, queue=teacher_queue(name),
                             teacher=TeacherRecipe.of(cfg), batch_fn=whole_batches(batch_fn),
                             flow=RoundFlow(window, strict, strict_timeout_s), rank=rank, steps=cfg.steps)
        if rank == 0 and end is not None:
            fleet.on_end = lambda: end(name)
        return SparseKDLoss(fleet, alpha=cfg.kd_alpha, batch_fn=batch_fn)  # one round per step, rows per call

    return build
