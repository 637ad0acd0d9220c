"""The distillation loss over sparse targets that come from elsewhere: one loss for every targets source.

A source is the fleet's teacher rounds (fleet.teacher.FleetTeacher) or the offline target cache
(trainer.kd.cache.CacheTargets). Each has `take(x, vocab) -> KDTargets | None` (None: the step trains on CE alone,
counted by the source), `seek(step)` and `stats()`; `SparseKDLoss` holds what the loss itself needs and nothing of
where the targets came from, so a run from the cache equals a run from the fleet on the same bytes.

Targets are made per step for the rank's whole batch (one round, one blob). Given the run's `batch_fn` (what the
trainer trains on at a step: (x, y), or trainer.distributed.MicroBatches under --micro-batch-size), the loss holds
the step's targets and gives each call its rows: every micro-batch, and the first rows a ZO-Curv refresh probes,
take the same blob's rows instead of missing it (their batch keys are not the step's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from trainer import health
from trainer.distributed import whole
from trainer.kd.estimators import kd_loss, sparse_ce
from trainer.kd.intake import accept
from trainer.kd.teacher import batch_key
from trainer.metrics import KD_MISSING
from wire.kd_targets import KDTargets


def report_missing(run: str, step: int | None, why: str) -> None:
    """A source's step without targets: counted in sparecycles_trainer_kd_missing_steps{run} and reported through
    trainer.health as teacher_missing, naming the 1-based step (as metrics.jsonl counts; `step` is 0-based, None
    when the batch is not in the plan)."""
    KD_MISSING.labels(run).inc()
    done = None if step is None else step + 1
    health.warn("teacher_missing", f"kd targets of step {done}: {why}; trained on CE alone", step=done)


def intake_step(blob: bytes | None, x: torch.Tensor, vocab: int, *, run: str, step: int | None,
                why: str) -> KDTargets | None:
    """A source's answer for the step of batch x (int64 (B, T)), for a student of `vocab` ids: the blob's targets
    (trainer.kd.intake.accept: decoded and checked, a refusal counted in ..._kd_rejected), or None, reported missing
    (report_missing) with `why` (the blob is None) or the refusal's reason. The one intake tail of every source."""
    targets = None
    if blob is not None:
        targets, why = accept(blob, batch_shape=(int(x.shape[0]), int(x.shape[1])), vocab=vocab, run=run)
    if targets is None:
        report_missing(run, step, why)
    return targets


def whole_batches(batch_fn: Callable[[int], Any]) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """step -> the rank's whole (x, y) of `batch_fn(step)` (micro-batches joined row-wise): the batch a step's
    targets are made for, so a source sends or stores one round per step whatever the micro-batch size."""
    return lambda step: whole(batch_fn(step))


def rows_in(whole_x: torch.Tensor, x: torch.Tensor) -> int | None:
    """The first row r0 with whole_x[r0 : r0 + B] == x (x int64 (B, T), whole_x (B0, T)), or None: where a
    micro-batch or a probe batch sits in its step's batch. Micro-batch offsets (multiples of B) are tried first."""
    n, total = int(x.shape[0]), int(whole_x.shape[0])
    if x.dim() != whole_x.dim() or x.shape[1:] != whole_x.shape[1:] or n > total or n == 0:
        return None
    aligned = range(0, total - n + 1, n)
    for r0 in [*aligned, *(r for r in range(total - n + 1) if r % n)]:
        if torch.equal(whole_x[r0 : r0 + n], x):
            return r0
    return None


def take_rows(targets: KDTargets, r0: int, n: int) -> KDTargets:
    """Rows [r0, r0 + n) of `targets` (ids/logp (B, T, K) -> (n, T, K)), views, not copies."""
    return replace(targets, ids=targets.ids[r0 : r0 + n], logp=targets.logp[r0 : r0 + n])


class TargetsSource(Protocol):
    """Where a run's sparse targets come from (see the module docstring)."""

    def take(self, x: torch.Tensor, vocab: int) -> KDTargets | None: ...

    def seek(self, step: int) -> None: ...

    def stats(self) -> dict[str, int]: ...


class SparseKDLoss:
    """loss_fn(model, (x, y)) -> (1 - alpha) * CE + alpha * KD (trainer.kd.estimators.kd_loss; float32 scalar,
    nats/token) with the sparse targets `source.take` gives for batch x; CE alone on a step without targets.
    x, y int64 (B, T). Repeated calls on one batch (a ZO method's +/- probes) reuse its targets. `last` keeps
    (ce, kd) floats (kd NaN on a missing step): the row-weighted mean over the step's backpropagated batches (its
    micro-batches; the first call on each), else (a pure-ZO step, all no_grad) the last call's.

    batch_fn(step) (optional): the batch the trainer trains on at `step`, (x, y) or MicroBatches; the source then
    must be built on whole_batches(batch_fn). With it, a call whose x is rows of the step being trained (or of the
    next step: the trainer moved on) takes those rows of that step's targets, and the source is asked once per
    step (see the module docstring); an x that is neither goes to the source as it is (which counts it missing).
    Without it, x must be a step's whole batch."""

    def __init__(self, source: TargetsSource, *, alpha: float, batch_fn: Callable[[int], Any] | None = None) -> None:
        self.source, self.alpha, self.batch_fn = source, alpha, batch_fn
        self._cached: tuple[int, KDTargets | None] | None = None
        self._step: tuple[torch.Tensor, KDTargets | None] | None = None  # the step held: (whole x, its targets)
        self._next = 0  # the next step whose targets are not yet taken
        self.last: tuple[float, float] = (math.nan, math.nan)
        self._terms: dict[int, tuple[float, float, int]] = {}  # this step's backpropagated batches: (ce, kd, rows)
        self.seeked = False
        self.before: dict[str, int] = {}  # the run's counts before this invocation (a resume: carry_counts)

    def carry_counts(self, record: dict[str, Any]) -> None:
        """A resume: the run's counts up to its checkpoint, read from the last step record kept (its kd_* counts,
        as stats() wrote them), so stats() counts the whole run and this_part() the steps of this invocation."""
        self.before = {k: int(v) for k, v in record.items()
                       if k.startswith("kd_") and k != "kd_loss" and isinstance(v, int | float)}

    def seek(self, step: int) -> None:
        """Start at 0-based `step` (the run's first step: 0, or a resume's checkpointed step)."""
        self.source.seek(step)
        self._step, self._next = None, step
        self.seeked = True

    def _take(self, x: torch.Tensor, vocab: int) -> KDTargets | None:
        """x's targets: its rows of the held step's, else of the next step's (taken from the source once), else
        the source's own answer for x."""
        if self.batch_fn is None:
            return self.source.take(x, vocab)
        r0 = rows_in(self._step[0], x) if self._step is not None else None
        if r0 is None:
            nxt = whole(self.batch_fn(self._next))[0]
            if (r0 := rows_in(nxt, x)) is None:
                return self.source.take(x, vocab)
            self._step, self._next = (nxt, self.source.take(nxt, vocab)), self._next + 1
            self._terms = {}  # a new step: its record's terms start over
        held = self._step[1]
        return None if held is None else take_rows(held, r0, int(x.shape[0]))

    def __call__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if not self.seeked:  # used outside trainer.train: a run from step 0
            self.seek(0)
        key = batch_key(x)
        logits = model(input_ids=x).logits  # (B, T, V)
        if self._cached is None or self._cached[0] != key:
            if self.batch_fn is None:  # no steps known: each new batch is its own record
                self._terms = {}
            self._cached = (key, self._take(x, int(logits.shape[-1])))
        targets = self._cached[1]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        kd = sparse_ce(logits, targets) if targets is not None else None
        self.last = (float(ce.detach()), float(kd.detach()) if kd is not None else math.nan)
        if torch.is_grad_enabled():  # a backpropagated batch (a micro-batch), not a ZO probe (those run no_grad)
            self._terms.setdefault(key, (*self.last, int(x.shape[0])))
        if self._terms:  # the step's record: the row-weighted mean over its micro-batches, not the last one's
            rows = sum(n for _, _, n in self._terms.values())
            self.last = (sum(c * n for c, _, n in self._terms.values()) / rows,
                         sum(k * n for _, k, n in self._terms.values()) / rows)
        return kd_loss(ce, kd, self.alpha)

    def stats(self) -> dict[str, int]:
        """The run's counts so far (kd_taken_steps, kd_missing_steps and the source's bytes): this invocation's
        (this_part) plus those before a resume (carry_counts)."""
        return {k: self.before.get(k, 0) + v for k, v in self.this_part().items()}

    def this_part(self) -> dict[str, int]:
        """The source's counts in this invocation alone."""
        return self.source.stats()

    def close(self) -> None:
        """The run is over (trainer.train calls it once, finished, failed or interrupted): the source's own close,
        where it has one (fleet.teacher.FleetTeacher: its teacher run ended at the coordinator)."""
        close = getattr(self.source, "close", None)
        if callable(close):
            close()
