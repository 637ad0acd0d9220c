"""Zeroth-order estimators: pure functions of probe losses, seeds and direction tensors (DESIGN.md §1-§2).

Notation (DESIGN.md §1): for a probe direction z and step ε, L0 = L(θ), L± = L(θ ± εz).
Losses arrive as float64 tensors of shape (K,) (one entry per probe); directions as float32/float64
tensors. Nothing here does I/O or touches global RNG state; the only randomness is counter-based and
derived from explicit seeds (`derive_seed`).

Sources: SPSA — Spall (1992), "Multivariate stochastic approximation using a simultaneous perturbation
gradient approximation"; MeZO — Malladi et al. (2023), "Fine-Tuning Language Models with Just Forward
Passes"; 1.5-SPSA — Chaubard, Kochenderfer, Ré, probe-space curvature weighting; Sophia — Liu et al.
(2023), "Sophia: A Scalable Stochastic Second-order Optimizer for Language Model Pre-training".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probe_kernels import direction

_MASK64 = (1 << 64) - 1
_SEED_MASK = (1 << 63) - 1  # seeds stay non-negative int64 so every tensor library can carry them

# Stream tags keep the derived streams of one seed disjoint (block scales vs. in-block signs, ...).
TAG_BLOCK_SCALE = 0x5C41E
TAG_BLOCK_SIGN = 0x516E
TAG_STEP = 0x57E9


def _splitmix64(x: int) -> int:
    """One SplitMix64 finaliser round (Steele, Lea, Flood 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *counters: int) -> int:
    """Derive a 63-bit seed from `seed` and any number of integer counters (pure, counter-based).

    Chains SplitMix64 over (seed, c1, c2, ...). Returns an int in [0, 2**63).
    Raises TypeError if any argument is not an int, ValueError if any is negative.
    """
    for v in (seed, *counters):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"derive_seed takes ints, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"derive_seed takes non-negative ints, got {v}")
    x = _splitmix64(seed & _MASK64)
    for c in counters:
        x = _splitmix64(x ^ (c & _MASK64))
    return x & _SEED_MASK


def step_seeds(run_seed: int, step: int, k: int) -> list[int]:
    """The K probe seeds of optimizer step `step` of a run: derive_seed(run_seed, TAG_STEP, step, k_i).

    Every replica recomputes the same seeds from (run_seed, step), so a pure-ZO update is a seed ledger.
    Raises ValueError if k < 1.
    """
    if k < 1:
        raise ValueError(f"need at least one probe per step, got k={k}")
    return [derive_seed(run_seed, TAG_STEP, step, i) for i in range(k)]


def _as_f64(x: torch.Tensor | Sequence[float] | float, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains non-finite values; drop failed probes before estimating")
    return t


def _check_eps(eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"probe step eps must be > 0, got {eps}")


def slope(l_plus, l_minus, eps: float) -> torch.Tensor:
    """Directional slope g = (L+ − L−)/(2ε) (DESIGN.md §1; Spall 1992), shape (K,) float64.

    Exact (to rounding) for quadratics: g = ∇L(θ)ᵀz. Units: loss per unit step along z.
    Raises ValueError for eps <= 0 or non-finite losses.
    """
    _check_eps(eps)
    lp, lm = _as_f64(l_plus, "l_plus"), _as_f64(l_minus, "l_minus")
    return (lp - lm) / (2.0 * eps)


def curvature(l_plus, l_minus, l0, eps: float) -> torch.Tensor:
    """Curvature along the probe h = (L+ + L− − 2 L0)/ε² (DESIGN.md §1), shape (K,) float64.

    Exact (to rounding) for quadratics: h = zᵀHz. `l0` is a scalar or (K,) (one clean pass per round).
    Raises ValueError for eps <= 0 or non-finite losses.
    """
    _check_eps(eps)
    lp, lm, c = _as_f64(l_plus, "l_plus"), _as_f64(l_minus, "l_minus"), _as_f64(l0, "l0")
    return (lp + lm - 2.0 * c) / (eps * eps)


def spsa15_weights(h, alpha: float, lam: float) -> torch.Tensor:
    """1.5-SPSA probe-space weights w_k = 1/max(|h_k|^α, λ) (Chaubard, Kochenderfer, Ré), (K,) float64.

    A diagonal preconditioner in probe space: high-curvature directions are down-weighted; λ > 0 caps
    the weight at 1/λ for flat directions. Raises ValueError for alpha < 0 or lam <= 0.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not lam > 0:
        raise ValueError(f"lambda must be > 0 (it bounds the weight by 1/lambda), got {lam}")
    ht = _as_f64(h, "h")
    return 1.0 / torch.clamp(ht.abs().pow(alpha), min=lam)


def mezo_coefficients(g, lr: float) -> torch.Tensor:
    """MeZO update coefficient c = −lr·g for its single Gaussian probe (Malladi et al. 2023), (1,) float64.

    The update is θ ← θ + c·z(s) − lr·wd·θ (decoupled weight decay applied by the caller).
    Raises ValueError unless exactly one probe slope is given.
    """
    gt = _as_f64(g, "g").reshape(-1)
    if gt.numel() != 1:
        raise ValueError(f"MeZO uses exactly one probe per step, got {gt.numel()} slopes")
    return -lr * gt


def spsa_coefficients(g, lr: float) -> torch.Tensor:
    """1SPSA(K) coefficients c_k = −(lr/K)·g_k (DESIGN.md §2; Spall 1992), shape (K,) float64.

    The update is θ ← θ + Σ_k c_k z_k, then decoupled weight decay.
    """
    gt = _as_f64(g, "g").reshape(-1)
    return -(lr / gt.numel()) * gt


def spsa15_coefficients(g, h, lr: float, alpha: float, lam: float) -> torch.Tensor:
    """1.5-SPSA(K, α, λ) coefficients c_k = −(lr/K)·w_k·g_k with w_k = 1/max(|h_k|^α, λ), (K,) float64.

    With α = 1 and λ below every |h_k|, K = 1 gives the 1-D Newton step θ − lr·(g/|h|)·z along the probe.
    Raises ValueError if g and h differ in length.
    """
    gt, ht = _as_f64(g, "g").reshape(-1), _as_f64(h, "h").reshape(-1)
    if gt.shape != ht.shape:
        raise ValueError(f"g and h must have one entry per probe, got {tuple(gt.shape)} vs {tuple(ht.shape)}")
    return -(lr / gt.numel()) * spsa15_weights(ht, alpha, lam) * gt


def leave_one_out_mean(h) -> torch.Tensor:
    """Control variate c_k = mean of h_j over j ≠ k, shape (K,) float64 (K >= 2).

    Independent of probe k, so E[(h_k − c_k)·f(z_k)] = E[h_k·f(z_k)] for any f with E f = 0: the
    estimators below stay exactly unbiased while the large tr(H) part of h cancels.
    Raises ValueError for K < 2.
    """
    ht = _as_f64(h, "h").reshape(-1)
    k = ht.numel()
    if k < 2:
        raise ValueError("a leave-one-out control variate needs at least two probes")
    return (ht.sum() - ht) / (k - 1)


def diag_estimate(h, z: torch.Tensor, c, m2: float, m4: float) -> torch.Tensor:
    """Per-coordinate diag(H) estimate D̂ = mean_k (h_k − c_k)(z_k⊙z_k − m2)/(m4 − m2²), (n,) float64.

    z: (K, n) iid entries with E z² = m2, E z⁴ = m4 (gauss8: m2 = 1, m4 = κ, so this is DESIGN.md §2's
    (h − c)(z⊙z − 1)/(κ − 1)). Since E[(zᵀHz)(z_i² − m2)] = (m4 − m2²)·H_ii, D̂ is unbiased for diag(H)
    for any c independent of z_k. Rademacher (m4 = m2² = 1) is rejected: z⊙z ≡ 1 carries no information.
    Raises ValueError on shape mismatch or m4 <= m2².
    """
    if not m4 > m2 * m2:
        raise ValueError("m4 must exceed m2**2 (Rademacher probes cannot identify diag(H); use gauss8)")
    ht = _as_f64(h, "h").reshape(-1)
    zt = torch.as_tensor(z, dtype=torch.float64)
    if zt.dim() != 2 or zt.shape[0] != ht.numel():
        raise ValueError(f"z must be (K, n) with K = len(h) = {ht.numel()}, got {tuple(zt.shape)}")
    ct = torch.broadcast_to(_as_f64(c, "c"), ht.shape)
    return ((ht - ct)[:, None] * (zt * zt - m2)).mean(0) / (m4 - m2 * m2)


def block_scaled_probe(a: torch.Tensor, r: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Assemble z = Σ_b a_b r_b: block b of the flat vector is a_b·r[block b], shape (n,) float32.

    a: (B,) per-block scales (gauss8); r: (n,) Rademacher signs; sizes: numel of each block in order.
    Raises ValueError if sizes do not cover r or len(sizes) != len(a).
    """
    if len(sizes) != a.numel() or sum(sizes) != r.numel():
        raise ValueError(f"need len(sizes) == len(a) and sum(sizes) == len(r); got {len(sizes)}, "
                         f"{a.numel()}, {sum(sizes)}, {r.numel()}")
    scale = torch.repeat_interleave(a.to(torch.float32), torch.as_tensor(list(sizes)))
    return scale * r.to(torch.float32)


def block_trace_estimate(h, a: torch.Tensor, c, m2: float, m4: float) -> torch.Tensor:
    """Per-block tr(H_bb) estimate T̂_b = mean_k (h_k − c_k)(a_kb² − m2)/(m4 − m2²), (B,) float64.

    For block-scaled probes z = Σ_b a_b r_b (a iid zero-mean with moments m2, m4; r Rademacher),
    E[(zᵀHz)(a_b² − m2)] = (m4 − m2²)·tr(H_bb) — cross-block terms vanish because E a = 0 and in-block
    terms give E[r_bᵀH_bb r_b] = tr(H_bb) (DESIGN.md §2). a: (K, B). Divide by block numel for the mean
    diagonal D_b. Raises ValueError on shape mismatch or m4 <= m2².
    """
    return diag_estimate(h, a, c, m2, m4)


def mixed_difference(l_pp, l_pm, l_mp, l_mm, eps: float) -> torch.Tensor:
    """uᵀHv ≈ [L(θ+εu+εv) − L(θ+εu−εv) − L(θ−εu+εv) + L(θ−εu−εv)]/(4ε²), shape (K,) float64.

    Exact (to rounding) for quadratics. Raises ValueError for eps <= 0 or non-finite losses.
    """
    _check_eps(eps)
    pp, pm = _as_f64(l_pp, "l_pp"), _as_f64(l_pm, "l_pm")
    mp, mm = _as_f64(l_mp, "l_mp"), _as_f64(l_mm, "l_mm")
    return (pp - pm - mp + mm) / (4.0 * eps * eps)


def rademacher_diag_estimate(uhv, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """diag(H) estimate mean_k (u_kᵀHv_k)(u_k⊙v_k), shape (n,) float64.

    u, v: (K, n) independent Rademacher probes. E[u_j v_l u_i v_i] = δ_ji δ_li, so
    E[(uᵀHv)(u⊙v)] = diag(H) (DESIGN.md §2) without needing a fourth moment above 1.
    Raises ValueError on shape mismatch.
    """
    m = _as_f64(uhv, "uhv").reshape(-1)
    ut, vt = torch.as_tensor(u, dtype=torch.float64), torch.as_tensor(v, dtype=torch.float64)
    if ut.shape != vt.shape or ut.dim() != 2 or ut.shape[0] != m.numel():
        raise ValueError(f"u and v must both be (K, n) with K = {m.numel()}, got {tuple(ut.shape)}, "
                         f"{tuple(vt.shape)}")
    return (m[:, None] * ut * vt).mean(0)


def block_scales(seed: int, n_blocks: int, dist: str = "gauss8") -> torch.Tensor:
    """Per-block scales a = gauss8 code stream of derive_seed(seed, TAG_BLOCK_SCALE), (B,) float32.

    a_b = probe_kernels.direction(derive_seed(seed, TAG_BLOCK_SCALE), offset=b, numel=1, gauss8): block b's
    scale is element b of its own seeded stream, so any worker computes it from (seed, b) alone.
    """
    return direction(derive_seed(seed, TAG_BLOCK_SCALE), 0, n_blocks, dist)


def block_sign_seed(seed: int) -> int:
    """Seed of the in-block Rademacher stream r of a block-scaled probe: derive_seed(seed, TAG_BLOCK_SIGN).

    r[offset:offset+numel] = probe_kernels.direction(block_sign_seed(seed), offset, numel, "rademacher"),
    indexed by the global canonical offset, so r does not depend on sharding.
    """
    return derive_seed(seed, TAG_BLOCK_SIGN)


def block_scaled_direction(seed: int, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The full block-scaled probe z(seed) = Σ_b a_b r_b over canonical blocks, shape (n,) float32.

    offsets/sizes: global flat offset and numel of each block (trainer.models.param_offsets order).
    Materialises z; for tests and small models (evaluation perturbs block by block without it).
    """
    a = block_scales(seed, len(sizes))
    rs = block_sign_seed(seed)
    parts = [a[b] * direction(rs, o, n, "rademacher") for b, (o, n) in enumerate(zip(offsets, sizes))]
    return torch.cat(parts)
