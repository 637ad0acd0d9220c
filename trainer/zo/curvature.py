"""Curvature state: a bias-corrected EMA of per-block (or per-coordinate) curvature.

Probe results are computed against published weight versions and may arrive late (DESIGN.md §2-§3). Which
single results count is decided by the probe backend's authority (the coordinator's intake, or
trainer.zo.backend.InProcessBackend); which rounds fold, and when, by the round lifecycle
(trainer.zo.rounds.RoundBook, whose counters the trainer logs). This state only averages what was folded.
"""

from __future__ import annotations

from typing import Any

import torch


class CurvatureState:
    """Bias-corrected EMA of a curvature vector, shape (n,) float64.

    estimate = ema / (1 − β^updates) (Adam-style bias correction, so the first contribution is taken as is).

    Args:
        size: length n of the curvature vector (blocks, or coordinates).
        beta: EMA factor in [0, 1).
    Raises ValueError for out-of-range arguments.
    """

    def __init__(self, size: int, beta: float = 0.9) -> None:
        if size < 1:
            raise ValueError(f"curvature size must be >= 1, got {size}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.size, self.beta = size, beta
        self.ema = torch.zeros(size, dtype=torch.float64)
        self.updates = 0

    @property
    def ready(self) -> bool:
        """True once at least one contribution has been folded in."""
        return self.updates > 0

    @property
    def estimate(self) -> torch.Tensor:
        """Bias-corrected EMA, shape (n,) float64; zeros before the first contribution."""
        if not self.updates:
            return torch.zeros_like(self.ema)
        return self.ema / (1.0 - self.beta**self.updates)

    def fold(self, contribution: torch.Tensor) -> None:
        """EMA update ema ← β·ema + (1 − β)·contribution, contribution shape (n,), finite.

        Raises ValueError on shape mismatch or non-finite values.
        """
        c = torch.as_tensor(contribution, dtype=torch.float64).reshape(-1)
        if c.numel() != self.size:
            raise ValueError(f"contribution has {c.numel()} entries, state holds {self.size}")
        if not torch.isfinite(c).all():
            raise ValueError("curvature contribution is not finite")
        self.ema.mul_(self.beta).add_(c, alpha=1.0 - self.beta)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (tensors and plain values)."""
        return {"size": self.size, "beta": self.beta, "ema": self.ema.clone(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` (other keys, e.g. an older checkpoint's counters, are ignored). Raises
        ValueError if the size differs."""
        if int(state["size"]) != self.size:
            raise ValueError(f"checkpoint curvature size {state['size']} != {self.size}")
        self.beta = float(state["beta"])
        self.ema = torch.as_tensor(state["ema"], dtype=torch.float64).clone()
        self.updates = int(state["updates"])
