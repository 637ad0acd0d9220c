"""Static per-role lr multipliers: Wang et al.'s table, normalised so the base lr means what AdamW's does.

Source: Wang et al., "The Sharpness Disparity Principle in Transformers for Accelerating Language Model
Pre-Training" (ICML 2025). Their Blockwise LR runs each block type at a fixed multiple of one base lr:
η_Norm = η, η_VO = 4η, η_FFN = 6η, η_QK = 8η, η_Emb = 10η (trainer.zo.multipliers.WANG2025_MULTIPLIERS),
reported ~1.9× fewer steps on LLaMA-1.1B at 0.13–0.3M tokens per step. The table gives lr *ratios*
relative to the sharpest block type (Norm); what the base η is, is a separate choice. (The project's seed
abstracts, ../shared/seeds/, do not cover this paper; the ratios are the published table as the
block-type lr comparison (experiments/regime) quotes it.)

Normalisation (`table_multipliers`, `norm`):
- "geomean" (default): divide the table by its parameter-weighted geometric mean
      m_G = t_G / exp(Σ_G n_G·log t_G / Σ_G n_G),
  so the mean log-lr over all parameters equals log(base lr): an lr bracket tuned for AdamW brackets this
  method too, and log-space is where lr sensitivity is flat enough to average (lr sweeps are log-spaced).
  On gpt2-small (n_Emb 39.4M, n_QK 14.2M, n_VO 14.2M, n_FFN 56.7M, n_Norm 38k) the divisor is ≈ 6.9:
  Emb 1.44, QK 1.15, FFN 0.86, VO 0.58, Norm 0.14 times the base lr.
- "smallest": the raw table (Norm = 1): the base lr is the Norm lr, every other block type runs 4–10× above
  it (the issue-17 arm `zocurv-group-fixed`; at AdamW's best lr, 6e-4, it lost 0.39 nats on gpt2-small).
An untied output head ("head") is not in the table; it gets 1 before normalisation (the table's smallest
ratio), as in WANG2025_MULTIPLIERS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from trainer.zo.groups import GroupMap, Role
from trainer.zo.multipliers import WANG2025_MULTIPLIERS

Norm = Literal["geomean", "smallest"]


def table_multipliers(gmap: GroupMap, table: Mapping[str, float] = WANG2025_MULTIPLIERS,
                      norm: Norm = "geomean") -> dict[Role, float]:
    """{role: multiplier} for the roles present in `gmap` from `table` ({role value: ratio}), normalised by
    `norm` (module docstring). Pure.

    Raises ValueError for a role of gmap missing from `table`, a non-positive or non-finite ratio, or an
    unknown `norm`.
    """
    if norm not in ("geomean", "smallest"):
        raise ValueError(f"norm must be 'geomean' or 'smallest', got {norm!r}")
    raw: dict[Role, float] = {}
    for role in gmap.roles:
        t = table.get(role.value)
        if t is None or not (math.isfinite(t) and t > 0):
            raise ValueError(f"table needs a finite ratio > 0 for role {role.value!r}, got {t!r}")
        raw[role] = float(t)
    if norm == "smallest":
        lo = min(raw.values())
        return {r: t / lo for r, t in raw.items()}
    n = {r: gmap.size(r) for r in raw}
    log_mean = sum(n[r] * math.log(t) for r, t in raw.items()) / sum(n.values())
    return {r: t / math.exp(log_mean) for r, t in raw.items()}


def log_mean_multiplier(gmap: GroupMap, mult: Mapping[Role, float]) -> float:
    """exp(Σ_G n_G·log m_G / Σ_G n_G): the parameter-weighted geometric mean of `mult` (1 for a "geomean"
    table). Raises ValueError for a non-positive multiplier or an empty map."""
    if not mult or any(not v > 0 for v in mult.values()):
        raise ValueError(f"multipliers must be > 0, got {dict(mult)}")
    n = {r: gmap.size(r) for r in mult}
    return math.exp(sum(n[r] * math.log(v) for r, v in mult.items()) / sum(n.values()))
