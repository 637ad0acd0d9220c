"""Offline precompute of teacher targets: fill a trainer.kd.cache.TargetCache for a planned run.

`fill(cfg, root, redis_url)` sends the teacher rounds of every step of [0, cfg.steps) the cache lacks through
fleet.teacher.FleetTeacher (one window of at most `window` steps at a time), takes each answer from Redis with
GETDEL, checks it (trainer.kd.intake.accept: wire.kd_targets.decode against the batch shape and the vocabulary)
and stores it (TargetCache.put, atomic). A rejected answer is sent again; a step unanswered after `timeout_s`
seconds is sent again (teacher workers come and go; a round is idempotent: the worker writes its answer with
SET NX, the same bytes for the same round). A step sent `attempts` times without a valid answer stops the fill
(FillError) with every answered step kept: a second invocation sends only the steps still missing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from fleet.kd_options import FillOptions
from fleet.teacher import FleetTeacher, RoundFlow, TeacherRecipe, teacher_queue
from trainer.kd.cache import KDPlan, TargetCache, plan_for
from trainer.kd.intake import accept
from trainer.kd.teacher import teacher_folder, teacher_sha256
from wire.teacher_messages import target_key


class FillError(RuntimeError):
    """A fill that could not finish: steps left unanswered (or rejected) after every attempt."""


@dataclass
class FillReport:
    """What one fill did. key: the plan's cache folder name; planned: steps in [0, steps); present: already
    stored before this fill; stored: stored by it; sent: teacher rounds sent (re-sends included); resent: of
    those, re-sends after a timeout or a rejection; rejected: answers refused at intake; bytes: blob bytes
    stored; wall_s: seconds."""

    key: str
    folder: str
    planned: int
    present: int
    stored: int = 0
    sent: int = 0
    resent: int = 0
    rejected: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    unanswered: list[int] = field(default_factory=list)


def _vocab(teacher: str) -> int:
    """The teacher's vocabulary size (config.json's vocab_size): the `vocab` its answers must carry."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(teacher_folder(teacher), local_files_only=True).vocab_size)


class _Filler:
    """One fill's sending and taking: rounds through `fleet`, answers GETDEL'd, checked and stored in `cache`."""

    def __init__(self, fleet: FleetTeacher, cache: TargetCache, opts: FillOptions, report: FillReport,
                 shape: tuple[int, int], vocab: int, progress: Callable[[int], None] | None,
                 log: Callable[[str], None]) -> None:
        self.fleet, self.cache, self.opts, self.report = fleet, cache, opts, report
        self.shape, self.vocab, self.progress, self.log = shape, vocab, progress, log
        self.tries: dict[int, int] = {}
        self.pending: dict[int, int] = {}  # batch key -> step, for rounds sent and not yet answered

    def send(self, steps: list[int]) -> None:
        """FleetTeacher.advance per contiguous run of `steps` (it sends [a, a + window) from next_step = a)."""
        i = 0
        while i < len(steps):
            j = i
            while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
                j += 1
            self.fleet.next_step, self.fleet.window = steps[i], j - i + 1
            self.fleet.advance(steps[i])
            i = j + 1
        for s in steps:
            self.tries[s] = self.tries.get(s, 0) + 1
            self.report.resent += self.tries[s] > 1
        self.report.sent += len(steps)
        self.pending.update({k: s for k, s in self.fleet.sent.items() if s in set(steps)})

    def take(self) -> list[int]:
        """Take every pending answer there (one round trip); store the valid ones; the steps to ask again."""
        fleet, again = self.fleet, []
        pipe = fleet.store.pipeline(transaction=False)
        for k in self.pending:
            pipe.getdel(target_key(fleet.run, fleet.rank, fleet.recipe, k))
        for (k, s), blob in zip(list(self.pending.items()), pipe.execute(), strict=True):
            if blob is None:
                continue
            del self.pending[k]
            fleet.sent.pop(k, None)
            targets, why = accept(blob, batch_shape=self.shape, vocab=self.vocab,
                                  run=fleet.queue.rsplit(".", 1)[-1])  # the queue's run name
            if targets is None:
                self.report.rejected += 1
                self.log(f"kd fill: step {s}: answer rejected ({why}); asking again")
                again.append(s)
                continue
            self.cache.put(s, blob)
            self.report.stored, self.report.bytes = self.report.stored + 1, self.report.bytes + len(blob)
            if self.progress is not None:
                self.progress(1)
        return again

    def window(self, steps: list[int]) -> None:
        """Ask for `steps` until each is stored; raises FillError when one was sent `attempts` times in vain."""
        self.send(steps)
        deadline = time.monotonic() + self.opts.timeout_s
        while self.pending:
            again = self.take()
            if time.monotonic() >= deadline:
                again += list(self.pending.values())
                deadline = time.monotonic() + self.opts.timeout_s
            again = sorted(set(again))
            if again:
                spent = [s for s in again if self.tries.get(s, 0) >= self.opts.attempts]
                if spent:
                    raise FillError(f"kd fill: step(s) {spent[:8]} had no valid answer after {self.opts.attempts} "
                                    f"sends ({self.opts.timeout_s:.0f} s each); {self.report.stored} stored: are "
                                    f"teacher workers on queue {self.fleet.queue}? Run the command again to resume")
                self.pending = {k: s for k, s in self.pending.items() if s not in set(again)}
                self.send(again)
            time.sleep(self.opts.poll_s)


def fill(cfg: Any, root: Path | str, redis_url: str, opts: FillOptions | None = None,
         progress: Callable[[int], None] | None = None, log: Callable[[str], None] = lambda m: None) -> FillReport:
    """Fill ROOT with the teacher targets of run settings `cfg` (trainer.config.TrainConfig with a teacher and
    kd_estimator sampled or topk; its steps, batches and recipe) from teacher workers on `redis_url` (their Celery
    broker and target store), asked as `opts` says (FillOptions); progress(n): called with n steps done (first those
    already stored, then each new one). Returns a FillReport. Raises ValueError for a non-redis URL,
    trainer.kd.cache.CachePlanError for a plan without targets, FillError when steps stay unanswered (those stored
    are kept), redis.RedisError when Redis cannot be reached."""
    opts = opts or FillOptions()
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"kd fill needs a redis:// URL, got {redis_url!r}")
    from coordinator.celery_app import make_celery
    from trainer.tasks import build_task

    t0, task = time.monotonic(), build_task(cfg)
    plan: KDPlan = plan_for(cfg, task)
    cache = TargetCache(root).open(plan)
    todo = cache.missing(range(cfg.steps))
    report = FillReport(key=plan.key(), folder=str(cache.dir), planned=cfg.steps, present=cfg.steps - len(todo))
    if progress is not None and report.present:
        progress(report.present)
    if todo:
        name = opts.run or f"kd-{teacher_sha256(cfg.teacher)[:12]}-{cfg.seed}"
        store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        store.ping()
        keys = opts.keys or f"{name[:55]}-{uuid.uuid4().hex[:8]}"  # the queue is shared; the answers are this fill's
        fleet = FleetTeacher(make_celery(redis_url), store, run=keys, queue=teacher_queue(name),
                             teacher=TeacherRecipe.of(cfg), batch_fn=task.batch, flow=RoundFlow(window=1),
                             rank=plan.rank)
        log(f"kd fill: {len(todo)} of {cfg.steps} steps to ask for on queue {fleet.queue} (cache {cache.dir})")
        filler = _Filler(fleet, cache, opts, report, (cfg.batch_size, cfg.seq_len), _vocab(cfg.teacher), progress,
                         log)
        try:
            for lo in range(0, len(todo), opts.window):
                filler.window(todo[lo:lo + opts.window])
        except FillError:
            report.unanswered, report.wall_s = sorted(cache.missing(todo)), time.monotonic() - t0
            raise
    report.wall_s = time.monotonic() - t0
    return report
