"""The distillation loss over sparse targets that come from elsewhere: one loss for every targets source.

A source is the fleet's teacher rounds (fleet.teacher.FleetTeacher) or the offline target cache
(trainer.kd.cache.CacheTargets). Each has `take(x, vocab) -> KDTargets | None` (None: the step trains on CE alone,
counted by the source), `seek(step)` and `stats()`; `SparseKDLoss` holds what the loss itself needs and nothing of
where the targets came from, so a run from the cache equals a run from the fleet on the same bytes.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from trainer import health
from trainer.kd.estimators import kd_loss, sparse_ce
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


class TargetsSource(Protocol):
    """Where a run's sparse targets come from (see the module docstring)."""

    def take(self, x: torch.Tensor, vocab: int) -> KDTargets | None: ...

    def seek(self, step: int) -> None: ...

    def stats(self) -> dict[str, int]: ...


class SparseKDLoss:
    """loss_fn(model, (x, y)) -> (1 - alpha) * CE + alpha * KD (trainer.kd.estimators.kd_loss; float32 scalar,
    nats/token) with the sparse targets `source.take` gives for batch x; CE alone on a step without targets.
    x, y int64 (B, T). Repeated calls on one batch (a ZO method's +/- probes) reuse its targets. `last` keeps
    (ce, kd) floats (kd NaN on a missing step)."""

    def __init__(self, source: TargetsSource, *, alpha: float) -> None:
        self.source, self.alpha = source, alpha
        self._cached: tuple[int, KDTargets | None] | None = None
        self.last: tuple[float, float] = (math.nan, math.nan)
        self.seeked = False

    def seek(self, step: int) -> None:
        """Start at 0-based `step` (the run's first step: 0, or a resume's checkpointed step)."""
        self.source.seek(step)
        self.seeked = True

    def __call__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if not self.seeked:  # used outside trainer.train: a run from step 0
            self.seek(0)
        key = batch_key(x)
        logits = model(input_ids=x).logits  # (B, T, V)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.source.take(x, int(logits.shape[-1])))
        targets = self._cached[1]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        kd = sparse_ce(logits, targets) if targets is not None else None
        self.last = (float(ce.detach()), float(kd.detach()) if kd is not None else math.nan)
        return kd_loss(ce, kd, self.alpha)

    def stats(self) -> dict[str, int]:
        """The source's counts so far (kd_taken_steps, kd_missing_steps and its bytes)."""
        return self.source.stats()
