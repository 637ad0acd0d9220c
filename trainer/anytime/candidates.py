"""Candidate models in the span of recent weights: coefficient vectors and the mixture θ(c) = Σ c_i θ_{v_i}.

A candidate is a coefficient vector c over the last k published versions v_1 < … < v_k (oldest first), with
Σ c_i = 1 so θ(c) stays on the affine hull of the iterates. The named families stand in for learning-rate
annealing without touching the trainer (LAWA: Sanyal et al. 2023, "Early weight averaging meets high
learning rates for LLM pre-training"; Hägele et al. NeurIPS 2024, "Scaling laws and compute-optimal
training beyond fixed training durations", section 4, EMA/SWA instead of a cooldown):

- `raw`:        c = e_k, the newest version.
- `ema(h)`:     c_i ∝ 2^{-(k - i)/h}: an exponential moving average of the published versions with a
                half-life of h versions, truncated to the k kept and renormalised.
- `uniform(m)`: c_i = 1/m on the m newest versions (LAWA's window average).

`mix_state` builds θ(c) in one fixed summation order (oldest version first, each term `c_i * θ_i` in fp32
added to an fp32 accumulator), so a worker and the trainer that hold the same versions build the same
tensors bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

SUM_TOL = 1e-9  # |Σ c - 1| allowed in a coefficient vector


def raw_coefs(k: int) -> tuple[float, ...]:
    """e_k: all weight on the newest of k versions. Raises ValueError for k < 1."""
    _check_k(k)
    return tuple(0.0 if i < k - 1 else 1.0 for i in range(k))


def ema_coefs(k: int, half_life: float) -> tuple[float, ...]:
    """Truncated EMA over k versions (oldest first): c_i = 2^{-(k-1-i)/h} / Σ_j 2^{-(k-1-j)/h}.

    Args:
        k: versions kept (>= 1).
        half_life: h > 0, in versions: the weight halves every h versions back in time.

    Raises:
        ValueError: k < 1 or half_life not finite and positive.
    """
    _check_k(k)
    if not (math.isfinite(half_life) and half_life > 0):
        raise ValueError(f"half_life must be finite and > 0 versions, got {half_life!r}")
    w = [2.0 ** (-(k - 1 - i) / half_life) for i in range(k)]
    s = math.fsum(w)
    return tuple(x / s for x in w)


def uniform_coefs(k: int, m: int) -> tuple[float, ...]:
    """The uniform average of the m newest of k versions (c_i = 1/m for i > k - m, else 0).

    Raises:
        ValueError: k < 1 or m not in [1, k].
    """
    _check_k(k)
    if not 1 <= m <= k:
        raise ValueError(f"m must be in [1, k={k}], got {m}")
    return tuple(0.0 if i < k - m else 1.0 / m for i in range(k))


def named_candidates(k: int, half_lives: Sequence[float], windows: Sequence[int]) -> dict[str, tuple[float, ...]]:
    """The named candidates over k versions: "raw", "ema{h}" for each half-life, "avg{m}" for each window
    m <= k (m = 1 is raw and skipped). Names are stable strings (h printed with `g`). Raises ValueError as
    the builders do."""
    out = {"raw": raw_coefs(k)}
    for h in half_lives:
        out[f"ema{h:g}"] = ema_coefs(k, h)
    for m in windows:
        if 1 < m <= k:
            out[f"avg{m}"] = uniform_coefs(k, m)
    return out


def check_coefs(coefs: Sequence[float], k: int | None = None) -> tuple[float, ...]:
    """Validate a coefficient vector: finite, Σ c = 1 within SUM_TOL, length k when given. Returns a tuple.

    Raises:
        ValueError: empty, wrong length, non-finite, or not summing to one.
    """
    c = tuple(float(x) for x in coefs)
    if not c or (k is not None and len(c) != k):
        raise ValueError(f"need {k or 'at least 1'} coefficients, got {len(c)}")
    if not all(math.isfinite(x) for x in c):
        raise ValueError(f"coefficients must be finite, got {c}")
    if abs(math.fsum(c) - 1.0) > SUM_TOL:
        raise ValueError(f"coefficients must sum to 1 (within {SUM_TOL}), got sum {math.fsum(c)!r}")
    return c


def mix_state(states: Sequence[Mapping[str, torch.Tensor]], coefs: Sequence[float]) -> dict[str, torch.Tensor]:
    """θ(c) = Σ_i c_i θ_i over state dicts (oldest first), in one fixed order: acc = c_1 θ_1; acc += c_i θ_i
    for i = 2..k, every product and sum in the tensor's own dtype (fp32 weights -> fp32 arithmetic), so any
    two processes holding the same versions build identical tensors. Terms with c_i = 0 are still added
    (0 * θ adds +0.0: the result does not depend on which terms vanish, and no branch on values).
    Non-floating tensors (buffers of ints) are taken from the newest state.

    Args:
        states: k state dicts with identical keys, shapes and dtypes; tensors on one device.
        coefs: k coefficients summing to 1 (check_coefs).

    Returns:
        A new state dict {name: tensor} on the states' device, same dtypes.

    Raises:
        ValueError: lengths differ, coefficients invalid, or the states' keys/shapes differ.
    """
    c = check_coefs(coefs, len(states))
    keys = list(states[-1].keys())
    for s in states:
        if list(s.keys()) != keys:
            raise ValueError("states must share the same keys in the same order")
    out: dict[str, torch.Tensor] = {}
    for name in keys:
        newest = states[-1][name]
        if not newest.is_floating_point():
            out[name] = newest.clone()
            continue
        acc = states[0][name].mul(c[0])
        for ci, s in zip(c[1:], states[1:], strict=True):
            t = s[name]
            if t.shape != newest.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(newest.shape)}")
            acc.add_(t.mul(ci))
        out[name] = acc
    return out


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
