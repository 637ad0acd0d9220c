"""How one optimizer step is taken: the `TrainMode` protocol the loop drives, and backprop AdamW.

The ZO modes (ZO-Curv, pure ZO) live in trainer.zo.modes; which mode a `--optimizer` name gets is the
registry's business (trainer.mode_builders.build_mode). Modes import neither the registry nor the config at run
time (the registry builds them: no import circle, tests/repo/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.distributed import backward
from trainer.models.losses import lm_batch_loss

if TYPE_CHECKING:
    from trainer.config import TrainConfig


class TrainMode(Protocol):
    """One optimizer step strategy. Backprop AdamW lives here; the ZO modes live in trainer.zo."""

    optimizer: torch.optim.Optimizer | None

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Run optimizer step `step` (0-based) on `batch` (the Task's batch: (x, y) int64 (B, T) for the LM);
        return logged scalars."""
        ...

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and JSON state beyond the model and optimizer, for checkpoints."""
        ...

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""
        ...


class AdamWMode:
    """Backprop AdamW with decoupled weight decay on matrices only and global-norm gradient clipping.

    `loss_fn(model, batch) -> scalar` defaults to the causal-LM loss on batch = (x, y).
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_batch_loss) -> None:
        self.loss_fn = loss_fn
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.model, self.cfg = model, cfg
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False,
        )

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss = backward(self.model, self.loss_fn, batch)  # micro-batches under torchrun: gradient accumulation
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        self.optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(gnorm)}

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        return None
