"""Training losses of the model families, shared by the loop (trainer.tasks) and the probe workers
(trainer.batch_losses picks one per wire batch kind): model code, not the loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (nats) of a causal LM: x, y int64 (B, T), y = x shifted by one. Scalar."""
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def lm_batch_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`lm_loss` as loss_fn(model, batch) with batch = (x, y) int64 (B, T). Scalar (nats/token)."""
    return lm_loss(model, *batch)
