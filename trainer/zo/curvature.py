"""Versioned curvature state: an EMA of per-block (or per-coordinate) curvature with a staleness bound.

Probe results are computed against published weight versions and may arrive late (DESIGN.md §2-§3).
Which single results count (stale, duplicate) is decided by the probe backend's authority (the
coordinator's intake, or trainer.zo.backend.InProcessBackend); `counts` accumulates those outcomes so the
trainer can log accepted/stale/duplicate per step (DESIGN.md §2, "Convergence-relevant knobs"), and
`staleness` bounds how long the optimizer waits for an incomplete round.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from coordinator.bounds import Staleness, check
from coordinator.staleness import is_stale


class Outcome(str, Enum):
    """What the backend's authority decided about one probe result (the keys of `CurvatureState.counts`)."""

    ACCEPTED = "accepted"
    STALE = "stale"
    DUPLICATE = "duplicate"


class CurvatureState:
    """Bias-corrected EMA of a curvature vector, shape (n,) float64, with version bookkeeping.

    estimate = ema / (1 − β^updates) (Adam-style bias correction, so the first contribution is taken
    as is). A round taken at version u is stale when current_version − u > staleness (`is_stale`).

    Args:
        size: length n of the curvature vector (blocks, or coordinates).
        beta: EMA factor in [0, 1).
        staleness: bound S in versions (coordinator.bounds.Staleness).
    Raises ValueError for out-of-range arguments.
    """

    def __init__(self, size: int, beta: float = 0.9, staleness: int = 2) -> None:
        if size < 1:
            raise ValueError(f"curvature size must be >= 1, got {size}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.size, self.beta, self.staleness = size, beta, check(Staleness, staleness)
        self.ema = torch.zeros(size, dtype=torch.float64)
        self.updates = 0
        self.current_version = 0
        self.counts = {o.value: 0 for o in Outcome}

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

    def set_version(self, version: int) -> None:
        """Advance the trainer's current version (monotone). Raises ValueError if it goes backwards."""
        if version < self.current_version:
            raise ValueError(f"version went backwards: {version} < {self.current_version}")
        self.current_version = version

    def is_stale(self, version: int) -> bool:
        """True if a round taken at `version` is older than the current version − staleness."""
        return is_stale(version, self.current_version, self.staleness)

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
        return {"size": self.size, "beta": self.beta, "staleness": self.staleness, "ema": self.ema.clone(),
                "updates": self.updates, "current_version": self.current_version, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` (older checkpoints' "seen" keys are ignored). Raises ValueError if the
        size differs."""
        if int(state["size"]) != self.size:
            raise ValueError(f"checkpoint curvature size {state['size']} != {self.size}")
        self.beta, self.staleness = float(state["beta"]), int(state["staleness"])
        self.ema = torch.as_tensor(state["ema"], dtype=torch.float64).clone()
        self.updates, self.current_version = int(state["updates"]), int(state["current_version"])
        self.counts = {o.value: int(state["counts"].get(o.value, 0)) for o in Outcome}
