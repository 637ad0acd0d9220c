"""The knobs of each training method (`--optimizer-option KEY=VALUE`): frozen pydantic models, defaults tuned.

trainer.methods' registry names each method's model (`Method.options`); `TrainConfig.optimizer_options` is
validated by it. Only pydantic here: the config, the registry and the modes all read these.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MethodOptions(BaseModel):
    """Base of a method's own knobs: frozen, unknown keys refused. Methods without knobs use it as is."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class BlockOptions(MethodOptions):
    """zocurv-block: s_b = clip(ρ/D_b, s_min, s_max) (ρ None: median of the positive D_b); curvature EMA β."""

    rho: float | None = Field(None, gt=0)
    s_min: float = Field(0.5, gt=0, le=1)
    s_max: float = Field(2.0, ge=1)
    curv_beta: float = Field(0.9, ge=0, lt=1)


class SophiaOptions(MethodOptions):
    """zocurv-sophia: curvature per block or per coordinate, Sophia's γ and its curvature EMA β2."""

    granularity: Literal["block", "coordinate"] = "block"
    gamma: float = Field(0.01, gt=0)
    beta2: float = Field(0.99, ge=0, lt=1)


class LineOptions(MethodOptions):
    """zocurv-line: multiplier bounds [s_min, s_max], per-round ratio bounds [r_min, r_max], EMA β."""

    s_min: float = Field(0.25, gt=0, le=1)
    s_max: float = Field(4.0, ge=1)
    r_min: float = Field(0.5, gt=0, le=1)
    r_max: float = Field(2.0, ge=1)
    curv_beta: float = Field(0.5, ge=0, lt=1)


class RoleOptions(MethodOptions):
    """zocurv-group / -global / -group-global / -group-fixed (trainer.zo.role_rules): group multipliers
    s_G = clip((S_max/S_G)^γ, 1, s_max) with EMA `group_beta`, trusted when |SNR| >= snr_min, a trusted
    negative curvature "skip"ped (default: the quadratic rule gives no step there) or read as "flat" (target
    s_max: the first H200 run's rule); global multiplier capped at m_max with EMA `global_beta`
    (trainer.zo.multipliers.update_group_multipliers)."""

    gamma: float = Field(0.5, ge=0)
    s_max: float = Field(10.0, ge=1)
    group_beta: float = Field(0.5, ge=0, lt=1)
    snr_min: float = Field(2.0, ge=0)
    negative: Literal["flat", "skip"] = "skip"
    m_max: float = Field(4.0, ge=1)
    global_beta: float = Field(0.5, ge=0, lt=1)


class RegimeOptions(MethodOptions):
    """zocurv-static / zocurv-trust (trainer.zo.regime_mode): `norm` of Wang et al.'s table
    ("geomean": parameter-weighted geometric mean 1, so the base lr means what AdamW's does; "smallest": the
    raw table, Norm = 1; trainer.zo.block_table). zocurv-trust only: `start` at the table or at 1, `batches`
    held-out probe batches per refresh (the SE is measured across them), the rule of
    trainer.zo.trust_region (log-EMA β, |z| > z_min on `agree` consecutive refreshes, per-refresh ratio in
    [r_min, r_max], multipliers in [m_min, m_max])."""

    norm: Literal["geomean", "smallest"] = "geomean"
    start: Literal["table", "one"] = "table"
    batches: int = Field(6, ge=2, le=1024)
    beta: float = Field(0.5, ge=0, lt=1)
    z_min: float = Field(3.0, ge=0)
    agree: int = Field(3, ge=1, le=1000)
    r_min: float = Field(0.5, gt=0, le=1)
    r_max: float = Field(2.0, ge=1)
    m_min: float = Field(0.05, gt=0, le=1)
    m_max: float = Field(20.0, ge=1)
