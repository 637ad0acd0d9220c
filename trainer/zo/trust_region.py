"""A calibrated block trust region: per-role lr multipliers from line fits along each role's displacement.

Every refresh, for each block type (role) G, with d_G = (θ_t − θ_prev) restricted to G's
elements (θ_prev: the weights at the previous refresh), the loss is measured at the designed points
θ_t + α·d_G, α ∈ `alphas` (α = 0 is θ_t; α = −1 would be θ_t with G moved back to θ_prev), on B held-out
batches. Per batch b a least-squares quadratic f_b(α) = c + b·α + ½·a·α² (trainer.zo.multipliers.quadratic_fit)
gives the best step along d_G relative to the one taken, r_{G,b} = clip(1 + α*, r_min, r_max) with α* = −b/a
(trainer.zo.multipliers.line_ratio: the last k steps of G should have been r times as long). The evidence is
y_{G,b} = log r_{G,b}; its mean ȳ_G over batches, standard error SE_G = std_b(y)/√B measured *across batches*
(the batch-to-batch variance that one batch's residual SNR omits: the sign flips at |SNR| 14–41 of the fair comparison (experiments/zocurv_fair)
came from that), and z_G = ȳ_G/SE_G (`fit_role`).

Update (`TrustRegion.update`), per role:
- evidence: |z_G| > z_min (default 3); the streak counts consecutive refreshes with evidence of one sign
  (a refresh without evidence, or of the other sign, restarts it);
- hysteresis: the multiplier changes only while the streak is >= agree (default 3);
- log-EMA with a clipped target: log m_G ← log m_G + (1 − β)·clip(ȳ_G, log r_min, log r_max), i.e. m moves
  toward m·r̄ (r̄ = exp ȳ clipped to [r_min, r_max] = [0.5, 2] by default) by the EMA weight 1 − β; so one
  refresh changes m by at most a factor 2^(1−β), and m stays within [m_min, m_max].
Starting values: the static table (trainer.zo.block_table) or 1 for every role.

Fixed point: with m_G at the best multiplier the fitted best step equals the one taken (ȳ = 0) and z is
noise, Student-t with B − 1 dof: with B = 6, P(|z| > 3) ≈ 0.03 and three in a row of one sign ≈ 2·0.015³ ≈
7e-6 per window, so the multiplier holds. Pure except `TrustRegion`, which holds the per-role state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from trainer.zo.multipliers import line_ratio, quadratic_fit

K = TypeVar("K")

DESIGN_ALPHAS: tuple[float, ...] = (-0.5, 0.0, 0.5, 1.0)  # brackets r ∈ [0.5, 2] (α* ∈ [−0.5, 1]); α = 0 is θ_t


@dataclass(frozen=True)
class RoleFit:
    """Evidence about one role's step from B batches: mean log-ratio ȳ, its across-batch SE, z = ȳ/SE, B, and
    the per-batch ratios r_b (clipped)."""

    log_ratio: float
    se: float
    z: float
    batches: int
    ratios: tuple[float, ...]


def fit_role(alphas: Sequence[float], losses: torch.Tensor | Sequence[Sequence[float]], *, r_min: float = 0.5,
             r_max: float = 2.0) -> RoleFit:
    """RoleFit from `losses` (B, J) float: losses[b][j] = L_b(θ_t + alphas[j]·d_G) on batch b (module docstring).

    SE = std(y, ddof=1)/√B; SE = 0 with ȳ ≠ 0 gives z = ±inf (all batches agree exactly: a noiseless
    quadratic); B = 1 gives SE = inf, z = 0 (no across-batch evidence). Raises ValueError for B < 1, a row
    length other than len(alphas), fewer than 3 distinct alphas or non-finite losses (quadratic_fit).
    """
    rows = torch.as_tensor(losses, dtype=torch.float64)
    if rows.ndim != 2 or rows.shape[0] < 1 or rows.shape[1] != len(alphas):
        raise ValueError(f"losses must be (B >= 1, {len(alphas)}), got {tuple(rows.shape)}")
    ratios = tuple(line_ratio(quadratic_fit(alphas, row.tolist()), r_min, r_max) for row in rows)
    y = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    mean = float(y.mean())
    if y.numel() < 2:
        return RoleFit(mean, math.inf, 0.0, 1, ratios)
    se = float(y.std(correction=1)) / math.sqrt(y.numel())
    z = mean / se if se > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
    return RoleFit(mean, se, z, int(y.numel()), ratios)


@dataclass(frozen=True)
class TrustRegionRule:
    """The update's knobs (module docstring). Raises ValueError for out-of-range values."""

    beta: float = 0.5
    z_min: float = 3.0
    agree: int = 3
    r_min: float = 0.5
    r_max: float = 2.0
    m_min: float = 0.05
    m_max: float = 20.0

    def __post_init__(self) -> None:
        if not (0 <= self.beta < 1 and self.z_min >= 0 and self.agree >= 1 and 0 < self.r_min <= 1 <= self.r_max
                and 0 < self.m_min <= 1 <= self.m_max):
            raise ValueError(f"bad trust-region rule {self}")


def step_multiplier(m: float, fit: RoleFit, streak: int, rule: TrustRegionRule) -> float:
    """The multiplier after one refresh given the streak *including* this refresh: unchanged below `agree`,
    else exp(log m + (1 − β)·clip(ȳ, log r_min, log r_max)) bounded to [m_min, m_max]. Pure."""
    if streak < rule.agree:
        return m
    y = min(max(fit.log_ratio, math.log(rule.r_min)), math.log(rule.r_max))
    return min(max(math.exp(math.log(m) + (1 - rule.beta) * y), rule.m_min), rule.m_max)


def next_streak(streak: int, fit: RoleFit, z_min: float) -> int:
    """Signed count of consecutive refreshes with |z| > z_min of one sign (+n: longer, −n: shorter steps
    wanted), after this refresh's `fit`. Pure."""
    if not abs(fit.z) > z_min:
        return 0
    s = 1 if fit.z > 0 else -1
    return streak + s if streak * s > 0 else s


@dataclass
class TrustRegion(Generic[K]):
    """Per-role multipliers and streaks of the calibrated trust region (module docstring).

    Attributes: mult {role: m}, streak {role: signed count}, rule. `update` applies one refresh's fits.
    """

    mult: dict[K, float]
    rule: TrustRegionRule = field(default_factory=TrustRegionRule)
    streak: dict[K, int] = field(default_factory=dict)

    def update(self, fits: Mapping[K, RoleFit]) -> dict[K, float]:
        """Fold one refresh's fits (roles absent from `fits` keep their state); returns the new multipliers."""
        for k, fit in fits.items():
            s = next_streak(self.streak.get(k, 0), fit, self.rule.z_min)
            self.streak[k] = s
            self.mult[k] = step_multiplier(self.mult.get(k, 1.0), fit, abs(s), self.rule)
        return dict(self.mult)

    def state(self) -> dict[str, Any]:
        """JSON-able state (keys as str via `.value` when the key has one)."""
        key = lambda k: getattr(k, "value", k)  # noqa: E731
        return {"mult": {key(k): v for k, v in self.mult.items()}, "streak": {key(k): v for k, v in self.streak.items()}}
