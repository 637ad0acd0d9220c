"""Offline precompute of teacher targets (issue 36): fill a trainer.kd.cache.TargetCache for a planned run.

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

from fleet.teacher import FleetTeacher, teacher_queue
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


def fill(cfg: Any, root: Path | str, redis_url: str, *, run: str | None = None, window: int = 32,
         timeout_s: float = 120.0, attempts: int = 5, poll_s: float = 0.05,
         progress: Callable[[int], None] | None = None, log: Callable[[str], None] = lambda m: None,
         keys: str | None = None) -> FillReport:
    """Fill ROOT with the teacher targets of run settings `cfg` (trainer.config.TrainConfig with a teacher and
    kd_estimator sampled or topk; its steps, batches and recipe) from teacher workers on `redis_url` (their Celery
    broker and target store), queue fleet.teacher.teacher_queue(run) (run default: kd-<teacher sha256[:12]>-<seed>,
    the name `train --teacher-rounds` uses, so the same workers serve both). window: rounds out at once (>= 1);
    timeout_s: seconds a window waits for answers before re-sending the unanswered (> 0); attempts: sends per step
    before giving up (>= 1); progress(n): called with n steps done (first those already stored, then each new one);
    keys: the run name of this fill's answers' keys (default: the queue's run name and this fill's own id, so two
    fills of one plan at once never take each other's answers, as two `train --teacher-rounds` do not). Returns a
    FillReport. Raises ValueError
    for bad arguments or a non-redis URL, trainer.kd.cache.CachePlanError for a plan without targets, FillError
    when steps stay unanswered (those stored are kept), redis.RedisError when Redis cannot be reached."""
    if window < 1 or not timeout_s > 0 or attempts < 1:
        raise ValueError(f"kd fill: window {window} (>= 1), timeout {timeout_s} s (> 0), attempts {attempts} (>= 1)")
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"kd fill needs a redis:// URL, got {redis_url!r}")
    from coordinator.celery_app import make_celery
    from trainer.tasks import build_task

    t0 = time.monotonic()
    task = build_task(cfg)
    plan: KDPlan = plan_for(cfg, task)
    cache = TargetCache(root).open(plan)
    todo = cache.missing(range(cfg.steps))
    report = FillReport(key=plan.key(), folder=str(cache.dir), planned=cfg.steps, present=cfg.steps - len(todo))
    if progress is not None and report.present:
        progress(report.present)
    if not todo:
        report.wall_s = time.monotonic() - t0
        return report
    name = run or f"kd-{teacher_sha256(cfg.teacher)[:12]}-{cfg.seed}"
    vocab, shape = _vocab(cfg.teacher), (cfg.batch_size, cfg.seq_len)
    store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
    store.ping()
    keys = keys or f"{name[:55]}-{uuid.uuid4().hex[:8]}"  # the queue is shared; the answers are this fill's
    fleet = FleetTeacher(make_celery(redis_url), store, run=keys, queue=teacher_queue(name), teacher=cfg.teacher,
                         batch_fn=task.batch,
                         kind=cfg.kd_estimator, k=cfg.kd_k, temperature=cfg.kd_temperature, seed=cfg.seed,
                         rank=plan.rank, window=1, student=cfg.model)
    log(f"kd fill: {len(todo)} of {cfg.steps} steps to ask for on queue {teacher_queue(name)} "
        f"(cache {cache.dir})")
    tries: dict[int, int] = {}

    def send(steps: list[int]) -> None:
        """FleetTeacher.advance per contiguous run of `steps`: it sends [a, a + window) from next_step = a."""
        i = 0
        while i < len(steps):
            j = i
            while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
                j += 1
            fleet.next_step, fleet.window = steps[i], j - i + 1
            fleet.advance(steps[i])
            i = j + 1
        for s in steps:
            tries[s] = tries.get(s, 0) + 1
            report.resent += tries[s] > 1
        report.sent += len(steps)

    for lo in range(0, len(todo), window):
        out = todo[lo:lo + window]
        send(out)
        pending = {k: s for k, s in fleet.sent.items() if s in set(out)}
        deadline = time.monotonic() + timeout_s
        while pending:
            pipe = store.pipeline(transaction=False)  # GETDEL every pending answer in one round trip
            for k in pending:
                pipe.getdel(target_key(keys, plan.rank, fleet.recipe, k))
            again: list[int] = []
            for (k, s), blob in zip(list(pending.items()), pipe.execute(), strict=True):
                if blob is None:
                    continue
                del pending[k]
                fleet.sent.pop(k, None)
                targets, why = accept(blob, batch_shape=shape, vocab=vocab, run=name)
                if targets is None:
                    report.rejected += 1
                    log(f"kd fill: step {s}: answer rejected ({why}); asking again")
                    again.append(s)
                    continue
                cache.put(s, blob)
                report.stored += 1
                report.bytes += len(blob)
                if progress is not None:
                    progress(1)
            if not pending and not again:
                break
            if time.monotonic() >= deadline:
                again += sorted(s for s in pending.values())
                deadline = time.monotonic() + timeout_s
            again = sorted(set(again))
            if again:
                spent = [s for s in again if tries.get(s, 0) >= attempts]
                if spent:
                    report.unanswered = sorted(cache.missing(todo))
                    report.wall_s = time.monotonic() - t0
                    raise FillError(f"kd fill: step(s) {spent[:8]} had no valid answer after {attempts} sends "
                                    f"({timeout_s:.0f} s each); {report.stored} stored, "
                                    f"{len(report.unanswered)} missing: are teacher workers on queue "
                                    f"{teacher_queue(name)}? Run the command again to resume")
                for s in again:
                    for k in [k for k, v in pending.items() if v == s]:
                        del pending[k]
                send(again)
                pending.update({k: s for k, s in fleet.sent.items() if s in set(again)})
            time.sleep(poll_s)
    report.wall_s = time.monotonic() - t0
    return report
