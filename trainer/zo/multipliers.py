"""Upward-only lr multipliers from ZO curvature: pure functions of scalars (DESIGN.md §2 (d), (e)).

(d) Per-group ("block type") multipliers. A probe z restricted to group G (Rademacher on G's elements, 0
elsewhere) gives h = (L+ + L− − 2·L0)/ε² = zᵀH_GG z + O(ε²) with E[h] = tr(H_GG) (E zzᵀ = I on G), so the
mean curvature per element is S_G = mean_k h_k / n_G, with standard error SE_G = std_k(h_k)/(√K·n_G) and
SNR_G = S_G/SE_G. For a sign-like (Adam) step of size lr·s_G on every element of G the second-order loss
cost is ½·lr²·s_G²·tr(H_GG), so equal cost per element across groups means s_G ∝ S_G^(−1/2); the
sharpest group keeps the base lr and flatter groups are raised, never lowered:
    s_G = clip((S_max / S_G)^γ, 1, s_max),   S_max = max over trusted groups of S_G,
then an EMA across refreshes. Source of the rule and of the measured ordering S(Emb) ≪ S(QK) < S(FFN) <
S(VO) ≪ S(Norm): Wang et al., "The Sharpness Disparity Principle in Transformers for Accelerating
Language Model Pre-Training", ICML 2025 (their tuned fixed table: WANG2025_MULTIPLIERS).

(e) A global multiplier from a quadratic fit of the loss along the multi-step displacement
d = θ_t − θ_{t−k}: f(α) = L(θ_t + α·d) ≈ c + b·α + ½·a·α² (least squares over probe points α_j; α = −1 is
θ_{t−k}, α = 0 is θ_t). The best point on the line from θ_{t−k} is α* = −b/a, i.e. the k steps should have
been r = 1 + α* times as long; the lr multiplier moves to clip(m·r, 1, m_max) (upward-only) by an EMA.
Sources: Mutschler & Zell, "Parabolic Approximation Line Search for DNNs" (PAL, NeurIPS 2020); Zhu et
al., "Automatic, dynamic, and nearly optimal learning rate specification via local quadratic
approximation" (LQA, Neural Networks 2021); the multi-step horizon counters the short-horizon bias of greedy per-step fits shown by Wu, Ren,
Liao & Grosse, "Understanding Short-Horizon Bias in Stochastic Meta-Optimization" (ICLR 2018).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

K = TypeVar("K")

# Wang et al. (ICML 2025), Blockwise LR, tuned table: η_Norm = η, η_VO = 4η, η_FFN = 6η, η_QK = 8η,
# η_Emb = 10η. An untied output head is not in their table; it keeps the base lr here (1).
WANG2025_MULTIPLIERS: dict[str, float] = {"norm": 1.0, "vo": 4.0, "ffn": 6.0, "qk": 8.0, "embed": 10.0, "head": 1.0}


@dataclass(frozen=True)
class CurvEstimate:
    """Mean per-element curvature S (loss units per unit² step per element), its standard error and SNR."""

    mean: float
    se: float
    snr: float


def group_curvature(h: torch.Tensor | Sequence[float], n: int) -> CurvEstimate:
    """S_G = mean(h)/n, SE = std(h, ddof=1)/(√K·n), SNR = S/SE from K >= 1 curvatures h (K,) along probes
    restricted to a group of n elements (module docstring). K = 1 gives SE = inf, SNR = 0; SE = 0 gives
    SNR = ±inf. Raises ValueError for n < 1, an empty or non-finite h."""
    ht = torch.as_tensor(h, dtype=torch.float64).reshape(-1)
    if n < 1 or ht.numel() == 0 or not bool(torch.isfinite(ht).all()):
        raise ValueError(f"need n >= 1 and finite h (K >= 1), got n={n}, h={ht.tolist()[:4]}")
    mean = float(ht.mean()) / n
    if ht.numel() < 2:
        return CurvEstimate(mean, math.inf, 0.0)
    se = float(ht.std(correction=1)) / (math.sqrt(ht.numel()) * n)
    snr = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else 0.0
    return CurvEstimate(mean, se, snr)


def sharpness_multipliers(s: Mapping[K, float], gamma: float = 0.5, s_max: float = 10.0) -> dict[K, float]:
    """s_G = clip((S_max/S_G)^γ, 1, s_max) with S_max = max_G S_G over the given (trusted) groups.

    S_G <= 0 (no positive curvature seen) gives s_max: the group is flat at this resolution. With no
    positive S_G at all every group gets 1 (nothing to compare against). Raises ValueError for γ < 0 or
    s_max < 1. Pure; every output is in [1, s_max] (upward-only).
    """
    if gamma < 0 or not s_max >= 1:
        raise ValueError(f"need gamma >= 0 and s_max >= 1, got {gamma}, {s_max}")
    pos = [v for v in s.values() if v > 0]
    if not pos:
        return {k: 1.0 for k in s}
    top = max(pos)
    return {k: (min(max((top / v) ** gamma, 1.0), s_max) if v > 0 else s_max) for k, v in s.items()}


def ema(prev: float, target: float, beta: float) -> float:
    """β·prev + (1 − β)·target (β in [0, 1)). Raises ValueError for β out of range."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    return beta * prev + (1 - beta) * target


def update_group_multipliers(prev: Mapping[K, float], est: Mapping[K, CurvEstimate], *, gamma: float = 0.5,
                             s_max: float = 10.0, beta: float = 0.5, snr_min: float = 2.0,
                             negative: str = "skip") -> dict[K, float]:
    """One refresh: groups whose |SNR| >= snr_min are trusted; their targets `sharpness_multipliers` (over
    trusted groups only) enter the EMA; untrusted groups keep their previous multiplier. Missing previous
    values start at 1. Outputs stay in [1, s_max] (convex combinations of values in [1, s_max]).

    negative: what a trusted *negative* mean curvature means — "skip" (default: left unchanged, like an
    untrusted group) or "flat" (target s_max; the first H200 run's rule, experiments/zocurv_fair/results).
    "skip" is the rule the derivation supports: s_G ∝ S_G^(−1/2) equalises the second-order cost
    ½·lr²·s_G²·n_G·S_G of a sign-like step, which is only a cost (and only bounds s_G) for S_G > 0. A
    confidently negative S_G says the loss is concave across the probe radius ε_G in that group: the
    quadratic model does not hold there and gives no step size — least of all "flat, raise to s_max" (on the
    H200 it drove FFN to ~10× after two such refreshes, and FFN read positive with |SNR| 17–47 in between).
    Raises ValueError for another value.
    """
    if negative not in ("flat", "skip"):
        raise ValueError(f"negative must be 'flat' or 'skip', got {negative!r}")
    trusted = {k: e.mean for k, e in est.items()
               if abs(e.snr) >= snr_min and (negative == "flat" or e.mean > 0)}
    target = sharpness_multipliers(trusted, gamma, s_max) if trusted else {}
    keys = set(prev) | set(est)
    out = {k: float(prev.get(k, 1.0)) for k in keys}
    for k, t in target.items():
        out[k] = min(max(ema(out[k], t, beta), 1.0), s_max)
    return out


@dataclass(frozen=True)
class QuadFit:
    """f(α) ≈ c + b·α + ½·a·α²; standard errors of b and a (nan with 3 points: no residual dof); rss."""

    c: float
    b: float
    a: float
    se_b: float
    se_a: float
    rss: float

    @property
    def argmin(self) -> float:
        """α* = −b/a (inf with the sign of −b when a <= 0: no minimum on the line)."""
        if self.a > 0:
            return -self.b / self.a
        return math.copysign(math.inf, -self.b) if self.b else 0.0

    @property
    def snr(self) -> float:
        """Curvature SNR a / se_a (nan when se_a is unknown)."""
        return self.a / self.se_a if self.se_a > 0 and math.isfinite(self.se_a) else math.nan


def quadratic_fit(alphas: Sequence[float], losses: Sequence[float]) -> QuadFit:
    """Least-squares fit of losses f(α_j) by c + b·α + ½·a·α² (float64), exact for quadratics.

    Standard errors from the residual variance σ² = RSS/(J − 3) and (XᵀX)⁻¹ (ordinary least squares).
    Raises ValueError for fewer than 3 distinct α, mismatched lengths or non-finite losses.
    """
    x = torch.as_tensor(alphas, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(losses, dtype=torch.float64).reshape(-1)
    if x.numel() != y.numel() or torch.unique(x).numel() < 3 or not bool(torch.isfinite(y).all()):
        raise ValueError("need >= 3 distinct alphas, one finite loss each")
    X = torch.stack([torch.ones_like(x), x, 0.5 * x * x], dim=1)
    xtx_inv = torch.linalg.inv(X.T @ X)
    coef = xtx_inv @ (X.T @ y)
    rss = float(((X @ coef - y) ** 2).sum())
    dof = x.numel() - 3
    if dof > 0:
        var = rss / dof * torch.diagonal(xtx_inv)
        se_b, se_a = float(var[1].sqrt()), float(var[2].sqrt())
    else:
        se_b = se_a = math.nan
    return QuadFit(float(coef[0]), float(coef[1]), float(coef[2]), se_b, se_a, rss)


def line_ratio(fit: QuadFit, r_min: float = 0.5, r_max: float = 2.0) -> float:
    """r = clip(1 + α*, r_min, r_max): how many times longer the k steps from θ_{t−k} (α = −1) should have
    been; no minimum on the line (a <= 0) gives r_max while the loss descends along d (b < 0), else r_min.
    Raises ValueError unless 0 < r_min <= 1 <= r_max."""
    if not 0 < r_min <= 1 <= r_max:
        raise ValueError(f"need 0 < r_min <= 1 <= r_max, got {r_min}, {r_max}")
    if fit.a <= 0:
        return r_max if fit.b < 0 else r_min
    return min(max(1.0 + fit.argmin, r_min), r_max)


def update_global_multiplier(m: float, r: float, *, m_max: float = 4.0, beta: float = 0.5) -> float:
    """m ← EMA_β(m, clip(m·r, 1, m_max)): upward-only (never below 1), capped at m_max. Pure."""
    if not m_max >= 1:
        raise ValueError(f"m_max must be >= 1, got {m_max}")
    return min(max(ema(m, min(max(m * r, 1.0), m_max), beta), 1.0), m_max)
