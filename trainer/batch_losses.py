"""The probe loss of each batch kind of the wire (`wire.batch`): what a worker or the fleet's trainer side calls
on a decoded batch. Its own module so that neither loss module imports the other (no import circle)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.models.losses import lm_batch_loss
from trainer.sentiment import classifier_loss
from wire.batch import FIELDS, BatchKind


def loss_for_kind(kind: BatchKind) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]:
    """loss_fn(model, batch) -> scalar tensor (nats) for batches of `kind` (the table in `wire.batch`'s docstring); ValueError for another kind."""
    if kind == "lm":
        return lm_batch_loss
    if kind == "classifier":
        return classifier_loss
    raise ValueError(f"unknown batch kind {kind!r}; use one of {sorted(FIELDS)}")
