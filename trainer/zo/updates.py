"""Update rules as pure functions over tensors and scalars: what one optimizer step does to the weights.

The optimizer classes (trainer.zo.optimizers, trainer.zo.zo_step) hold state (moments, fp32 masters,
curvature EMA) and talk to probe backends; the arithmetic of a step lives here, the way Muon's
`muon_update` sits apart from its optimizer class. Nothing here reads global state, does I/O or draws
randomness. The `*_` functions follow torch.optim's functional API (torch.optim.adamw): they update the
tensors they are given in place (weights, moment buffers) and keep no state of their own; the others
return new tensors.

Contents:
- `adamw_update_`: one AdamW step on one tensor with an lr multiplier (Loshchilov & Hutter 2019; op
  order of torch.optim.AdamW(foreach=False), so multiplier 1 is torch's AdamW bit for bit);
- `sophia_update_` / `sophia_clip`: Sophia's clipped update (Liu et al. 2023, Algorithm 3);
- `block_multipliers`, `line_ratios`, `line_multipliers`, `clipped_fraction`: the ZO-Curv step-size
  multipliers from curvature (DESIGN.md §2);
- `zo_coefficients`, `decoupled_decay_`: the pure-ZO step (MeZO / 1SPSA / 1.5-SPSA) as seed-ledger
  coefficients, plus the decay applied before the replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.zo import estimators as est

ZOMethod = Literal["mezo", "1spsa", "1.5spsa"]


# ---- AdamW ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's AdamW hyper-parameters: lr; beta1, beta2 in [0, 1); eps > 0 (Adam's ε in the
    denominator, not a probe's); weight_decay >= 0 (decoupled)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: Mapping[str, Any], lr: float | None = None) -> AdamWHyper:
        """Those of a torch param group ({"lr", "betas", "eps", "weight_decay"}), its lr replaced by `lr` if given."""
        beta1, beta2 = group["betas"]
        return cls(group["lr"] if lr is None else lr, beta1, beta2, group["eps"], group["weight_decay"])


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: float, hp: AdamWHyper, lr_scale: float | torch.Tensor = 1.0,
                  decay_scale: float | torch.Tensor = 1.0) -> None:
    """One AdamW step on one tensor, in place: `param`, `exp_avg` and `exp_avg_sq` are updated.

    θ ← θ·(1 − lr·wd·d);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²;
    θ ← θ − (lr·s/(1 − β1^t))·m / (√v/√(1 − β2^t) + eps)
    (Loshchilov & Hutter 2019, Algorithm 2). The operations and their order are torch.optim.AdamW's
    single-tensor path (torch 2.x `_single_tensor_adamw`), so with s = d = 1 the result equals
    torch.optim.AdamW(foreach=False) bit for bit. s scales the step size only (ZO-Curv (a)-(c) multipliers); a
    multiplier of the whole per-element lr, decay included (separate AdamW lrs, ZO-Curv (d)), is s = d, or for a
    float simply lr·s with s = d = 1.

    Args:
        param, grad, exp_avg, exp_avg_sq: same shape and float dtype (fp32 masters and moments here).
        step: 1-based step count t of this tensor's moments (after incrementing; int or float, as torch keeps it).
        hp: the group's lr, beta1, beta2, eps and weight_decay (AdamWHyper).
        lr_scale: step-size multiplier s, a float or a float32 tensor broadcastable to `param` (per column).
        decay_scale: decay multiplier d, a float or such a tensor.
    """
    lr, beta1, beta2 = hp.lr, hp.beta1, hp.beta2
    param.mul_(1 - lr * hp.weight_decay * decay_scale)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(hp.eps)
    if isinstance(lr_scale, torch.Tensor):
        param.addcdiv_(exp_avg * lr_scale, denom, value=-lr / (1 - beta1**step))
    else:
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step) * lr_scale)


# ---- Sophia --------------------------------------------------------------------------------------------
def sophia_clip(exp_avg: torch.Tensor, curvature: torch.Tensor, gamma: float, eps: float
                ) -> tuple[torch.Tensor, int]:
    """Sophia's preconditioned, clipped direction clip(m / max(γ·D, ε), −1, 1) and how many entries hit the clip.

    Args:
        exp_avg: gradient EMA m, any shape, float.
        curvature: diagonal curvature D broadcastable to m (0 or negative: no curvature, the step is sign(m)
            wherever |m| >= ε).
        gamma > 0, eps > 0: Sophia's γ and ε (Liu et al. 2023, Algorithm 3).
    Returns:
        (direction, same shape/dtype as m, every entry in [−1, 1]; number of entries with |ratio| >= 1).
    """
    ratio = exp_avg / torch.clamp(gamma * curvature, min=eps)
    return ratio.clamp(-1.0, 1.0), int((ratio.abs() >= 1.0).sum())


def sophia_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, curvature: torch.Tensor, *,
                   lr: float, beta1: float, gamma: float, eps: float, weight_decay: float) -> int:
    """One Sophia step on one tensor, in place (`param`, `exp_avg`); returns the number of clipped entries.

    m ← β1·m + (1 − β1)·g;  θ ← θ·(1 − lr·wd);  θ ← θ − lr·clip(m / max(γ·D, ε), −1, 1)
    (Liu et al. 2023, Algorithm 3, with D the ZO curvature estimate instead of a Hessian sample).
    Shapes: param, grad, exp_avg alike; curvature broadcastable to them.
    """
    exp_avg.lerp_(grad, 1 - beta1)
    param.mul_(1 - lr * weight_decay)
    direction, clipped = sophia_clip(exp_avg, curvature, gamma, eps)
    param.add_(direction, alpha=-lr)
    return clipped


# ---- ZO-Curv multipliers -------------------------------------------------------------------------------
def block_multipliers(d: torch.Tensor, rho: float | None, s_min: float, s_max: float) -> torch.Tensor:
    """s_b = clip(ρ/D_b, s_min, s_max), s_max where D_b <= 0; ρ = None → median of positive D_b. (B,) float64.

    d: (B,) float64 per-block mean diagonal curvature tr(H_bb)/n_b (DESIGN.md §2, ZO-Curv (a)). With no
    positive D_b and ρ = None the multipliers are 1 (plain AdamW).
    """
    pos = d[d > 0]
    if rho is None:
        if pos.numel() == 0:
            return torch.ones_like(d)
        rho = float(pos.median())
    s = torch.where(d > 0, rho / d.clamp(min=torch.finfo(torch.float64).tiny), torch.full_like(d, s_max))
    return s.clamp(s_min, s_max)


def line_ratios(g: torch.Tensor, h: torch.Tensor, tau: torch.Tensor, r_min: float, r_max: float) -> torch.Tensor:
    """Per-block step ratio r_b = clip(1 − g_b/(h_b·τ_b), r_min, r_max); 1 where τ_b = 0. (B,) float64.

    g, h: slope and curvature along the unit-RMS step direction û_b; τ_b: RMS of the step taken.
    On the quadratic model along the step, 1 − g/(h·τ) is the best step in units of the one taken
    (DESIGN.md §2, ZO-Curv (c)). Non-positive curvature: r_max when the loss still descends (g < 0), else r_min.
    """
    safe_h = torch.where(h > 0, h, torch.ones_like(h))
    safe_tau = torch.where(tau > 0, tau, torch.ones_like(tau))
    newton = 1.0 - g / (safe_h * safe_tau)
    r = torch.where(h > 0, newton, torch.where(g < 0, torch.full_like(g, r_max), torch.full_like(g, r_min)))
    return torch.where(tau > 0, r.clamp(r_min, r_max), torch.ones_like(r))


def line_multipliers(current: torch.Tensor, ratio: torch.Tensor, s_min: float, s_max: float) -> torch.Tensor:
    """The next target multipliers clip(s_b·r_b, s_min, s_max): the multiplier that produced the step, rescaled
    by the ratio `line_ratios` measured along it. current, ratio: (B,) float64. Returns (B,) float64."""
    return (current * ratio).clamp(s_min, s_max)


def clipped_fraction(s: torch.Tensor, lo: float, hi: float) -> float:
    """Fraction of the entries of `s` at or beyond either clip bound (lo, hi), in [0, 1]."""
    return float(((s <= lo) | (s >= hi)).double().mean())


# ---- pure ZO -------------------------------------------------------------------------------------------
def zo_coefficients(method: ZOMethod, lp: torch.Tensor, lm: torch.Tensor, l0: torch.Tensor | None, eps: float,
                    lr: float, alpha: float = 0.1, lam: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Update coefficients c (K,) float64 for `method` from probe losses, and scalars to log.

    The step is θ ← θ + Σ_k c_k·z(s_k) (replayed from the seeds). lp, lm, l0: (K,) float64 losses
    L(θ ± εz_k) and L(θ) (l0 may be None except for 1.5spsa).
    mezo: c = −lr·g (K = 1, Malladi et al. 2023); 1spsa: c_k = −(lr/K)·g_k (Spall 1992);
    1.5spsa: c_k = −(lr/K)·g_k/max(|h_k|^α, λ) (Chaubard, Kochenderfer, Ré) — needs l0.
    Raises ValueError for an unknown method or a 1.5-SPSA call without l0.
    """
    g = est.slope(lp, lm, eps)
    stats = {"g_mean": float(g.mean()), "g_abs_mean": float(g.abs().mean())}
    if method == "mezo":
        c = est.mezo_coefficients(g, lr)
    elif method == "1spsa":
        c = est.spsa_coefficients(g, lr)
    elif method == "1.5spsa":
        if l0 is None:
            raise ValueError("1.5-SPSA needs the clean loss L0 (submit rounds with want_clean=True)")
        h = est.curvature(lp, lm, l0, eps)
        w = est.spsa15_weights(h, alpha, lam)
        c = est.spsa15_coefficients(g, h, lr, alpha, lam)
        stats.update({"h_mean": float(h.mean()), "h_std": float(h.std()) if h.numel() > 1 else 0.0,
                      "w_mean": float(w.mean()), "frac_weight_floored": float((h.abs().pow(alpha) <= lam)
                                                                              .double().mean())})
    else:
        raise ValueError(f"unknown ZO method {method!r}; use mezo, 1spsa or 1.5spsa")
    return c, stats


def decoupled_decay_(weights: Sequence[torch.Tensor], lr: float, weight_decay: float) -> None:
    """θ ← θ·(1 − lr·wd) in place on every tensor with dim >= 2 (matrices; the GPT-2 recipe leaves biases and
    norms undecayed). Applied before a pure-ZO replay this equals MeZO's θ − lr·(g·z + wd·θ) with the decay
    taken at the old θ. No-op when weight_decay is 0."""
    if not weight_decay:
        return
    for w in weights:
        if w.dim() >= 2:
            w.mul_(1.0 - lr * weight_decay)
