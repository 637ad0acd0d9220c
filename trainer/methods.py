"""The registry of training methods: every `--optimizer` name, what kind it is and how to build it.

One table (`METHODS`) replaces the name lists that used to be spread over the config, the CLIs, the
training modes and the benchmarks: `TrainConfig` validates `optimizer`/`optimizer_options` against it,
the CLIs take their choices from it, `trainer.modes.build_mode` builds through it.

Adding a method (e.g. a new ZO-Curv variant) is one entry in `METHODS` below:

    Method("zocurv-foo", "zo-curv", "one line for --help",
           build=build_zocurv_mode,            # the one ZO-Curv loop mode (trainer.zo.modes.ZOCurvMode)
           optimizer=_zocurv_foo,              # (param_groups, blocks, cfg, options) -> a CurvRule optimizer
           options=FooOptions)                 # frozen pydantic model of the method's own knobs, with defaults

`options` holds knobs that only this method reads; `TrainConfig.optimizer_options` (CLI:
`--optimizer-option KEY=VALUE`) overrides their defaults and is validated by that model. Run-wide knobs
(lr, probes, eps, staleness, curvature_interval, ...) stay in TrainConfig.

This module imports only pydantic and the standard library: the config and the CLIs load it at import
time, so builders import torch and the optimizers inside their bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainConfig
    from trainer.zo.backend import ProbeBackend
    from trainer.zo.probes import Block

Kind = Literal["first-order", "zo-curv", "pure-zo"]
KINDS: tuple[Kind, ...] = ("first-order", "zo-curv", "pure-zo")

# build(cfg, model, loss_fn, backend, timing) -> a trainer.modes.TrainMode. backend: where probe rounds go (None:
# in process on `model`); timing: when ZO-Curv rounds fold (trainer.zo.rounds.FOLD_TIMINGS). First-order methods
# ignore both, pure-ZO methods the timing (their steps wait for their rounds).
Builder = Callable[["TrainConfig", "torch.nn.Module", Callable[..., Any], "ProbeBackend | None", str], Any]
# optimizer(param_groups, blocks, cfg, options) -> a trainer.zo.optimizers.CurvRule torch optimizer (zo-curv only);
# blocks: the model's canonical blocks (trainer.zo.probes.Block: name, parameter, offset), in order.
OptimizerFactory = Callable[[list[dict], list["Block"], "TrainConfig", BaseModel], Any]


class MethodOptions(BaseModel):
    """Base of a method's own knobs: frozen, unknown keys refused. Methods without knobs use it as is."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: the `--optimizer` value.
        kind: "first-order" (backprop only), "zo-curv" (backprop step shaped by curvature from probe
            rounds) or "pure-zo" (forward passes only: every step is a probe round).
        summary: one line for --help and the README.
        build: (cfg, model, loss_fn, backend, timing) -> TrainMode.
        options: pydantic model of the method's own knobs (defaults = the tuned values).
        optimizer: zo-curv methods built by `build_zocurv_mode`: (param_groups, blocks, cfg, options) -> the
            ZO-Curv torch optimizer, a trainer.zo.optimizers.CurvRule (zocurv-static/-trust: their own mode).
        tasks: the `--task` values it runs on.
        fleet: whether its probe rounds can go to a fleet backend (`sparecycles up`); False: in process only.
        no_fleet_why: for a method with probes and fleet=False, why (`train --coordinator` / `up` say it).
        needs_probes: whether it evaluates probe rounds at all (default: kind != "first-order"; False for a
            zero-probe ablation).
        probes_along_step: its rounds probe along θ_s − θ_{s−k}, which needs an earlier version: the first round
            is at step k = curvature_interval, not 0 (trainer.preflight.probe_rounds).
        sentiment_lr: default lr on the sentiment task when the user gives none (picked on validation
            accuracy: trainer/zo/results/sentiment_summary.json); None: the preset's lr.
    Raises ValueError (at definition) for an unknown kind or an `optimizer` on a non-zo-curv method.
    """

    name: str
    kind: Kind
    summary: str
    build: Builder
    options: type[MethodOptions] = MethodOptions
    optimizer: OptimizerFactory | None = None
    tasks: tuple[str, ...] = ("lm",)
    sentiment_lr: float | None = None
    fleet: bool = True
    no_fleet_why: str = ""
    needs_probes: bool | None = None
    probes_along_step: bool = False

    def __post_init__(self) -> None:
        if self.needs_probes is None:  # default: every kind but first-order sends probe rounds
            object.__setattr__(self, "needs_probes", self.kind != "first-order")
        if self.kind not in KINDS:
            raise ValueError(f"method {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.optimizer is not None and self.kind != "zo-curv":
            raise ValueError(f"method {self.name!r}: an `optimizer` factory is for zo-curv methods only")
        if self.needs_probes and not self.fleet and not self.no_fleet_why:
            raise ValueError(f"method {self.name!r}: say why its probes cannot go to a fleet (`no_fleet_why`)")

    def parse_options(self, given: dict[str, Any] | None = None) -> MethodOptions:
        """The method's options with `given` overriding the defaults. Raises pydantic.ValidationError."""
        return self.options(**(given or {}))


# ---- builders (lazy imports: this module stays torch-free) --------------------------------------------
def build_first_order_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """Backprop AdamW (trainer.modes.AdamWMode); `backend` and `timing` are unused."""
    from trainer.modes import AdamWMode

    return AdamWMode(model, cfg, loss_fn)


def build_zocurv_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """Backprop with a ZO-Curv optimizer (the method's `optimizer` factory) and periodic probe rounds."""
    from trainer.zo.modes import ZOCurvMode

    return ZOCurvMode(cfg, model, loss_fn, backend, timing)


def build_pure_zo_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """MeZO / 1SPSA / 1.5-SPSA (trainer.zo.modes.PureZOMode), K probes per step."""
    from trainer.zo.modes import PureZOMode

    return PureZOMode(cfg, model, loss_fn, backend)


# ---- ZO-Curv variants ----------------------------------------------------------------------------------
def _zocurv_common(blocks, cfg) -> dict[str, Any]:
    return {"blocks": [b.param for b in blocks], "probe_eps": cfg.eps, "seed": cfg.seed}


class BlockOptions(MethodOptions):
    """zocurv-block: s_b = clip(ρ/D_b, s_min, s_max) (ρ None: median of the positive D_b); curvature EMA β."""

    rho: float | None = Field(None, gt=0)
    s_min: float = Field(0.5, gt=0, le=1)
    s_max: float = Field(2.0, ge=1)
    curv_beta: float = Field(0.9, ge=0, lt=1)


def _zocurv_block(groups, blocks, cfg, o: BlockOptions):
    from trainer.zo.optimizers import ZOCurvBlockAdamW

    return ZOCurvBlockAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), probes=cfg.probes, rho=o.rho,
                            s_min=o.s_min, s_max=o.s_max, curv_beta=o.curv_beta, **_zocurv_common(blocks, cfg))


class SophiaOptions(MethodOptions):
    """zocurv-sophia: curvature per block or per coordinate, Sophia's γ and its curvature EMA β2."""

    granularity: Literal["block", "coordinate"] = "block"
    gamma: float = Field(0.01, gt=0)
    beta2: float = Field(0.99, ge=0, lt=1)


def _zocurv_sophia(groups, blocks, cfg, o: SophiaOptions):
    from trainer.zo.optimizers import ZOCurvSophia

    return ZOCurvSophia(groups, lr=cfg.lr, betas=(cfg.beta1, o.beta2), gamma=o.gamma, granularity=o.granularity,
                        probes=cfg.probes, **_zocurv_common(blocks, cfg))


class LineOptions(MethodOptions):
    """zocurv-line: multiplier bounds [s_min, s_max], per-round ratio bounds [r_min, r_max], EMA β."""

    s_min: float = Field(0.25, gt=0, le=1)
    s_max: float = Field(4.0, ge=1)
    r_min: float = Field(0.5, gt=0, le=1)
    r_max: float = Field(2.0, ge=1)
    curv_beta: float = Field(0.5, ge=0, lt=1)


def _zocurv_line(groups, blocks, cfg, o: LineOptions):
    from trainer.zo.optimizers import ZOCurvLine

    return ZOCurvLine(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), s_min=o.s_min, s_max=o.s_max,
                      r_min=o.r_min, r_max=o.r_max, curv_beta=o.curv_beta, **_zocurv_common(blocks, cfg))


class RoleOptions(MethodOptions):
    """zocurv-group / -global / -group-global / -group-fixed (trainer.zo.role_rules; issue 17): group multipliers
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


def _zocurv_role(groups, blocks, cfg, o: RoleOptions):
    from trainer.zo.groups import assign_roles
    from trainer.zo.role_rules import ZOCurvRoleAdamW

    name = cfg.optimizer
    return ZOCurvRoleAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=[b.param for b in blocks],
                           gmap=assign_roles([(b.name, b.param) for b in blocks]),
                           group_probes=name in ("zocurv-group", "zocurv-group-global"),
                           line=name in ("zocurv-global", "zocurv-group-global"), fixed=name == "zocurv-group-fixed",
                           options=o, probe_budget=cfg.probe_budget, probe_eps=cfg.eps,
                           interval=cfg.curvature_interval, seed=cfg.seed)
class RegimeOptions(MethodOptions):
    """zocurv-static / zocurv-trust (trainer.zo.regime_mode; issue 29): `norm` of Wang et al.'s table
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


def build_regime_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """zocurv-static / zocurv-trust (trainer.zo.regime_mode.BlockRegimeMode). Raises ValueError for a backend:
    the trust region's group-line probes run in process only."""
    from trainer.zo.regime_mode import BlockRegimeMode

    return BlockRegimeMode(cfg, model, loss_fn, backend)


# ---- the table -----------------------------------------------------------------------------------------
_LM_AND_SENTIMENT = ("lm", "sentiment")

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("adamw", "first-order", "backprop AdamW, the baseline", build_first_order_mode,
           tasks=_LM_AND_SENTIMENT, sentiment_lr=2e-4),
    Method("zocurv-block", "zo-curv", "AdamW with per-block multipliers from block-scaled probe curvature",
           build_zocurv_mode, BlockOptions, _zocurv_block),
    Method("zocurv-sophia", "zo-curv", "Sophia's clipped step with ZO curvature (per block or coordinate)",
           build_zocurv_mode, SophiaOptions, _zocurv_sophia),
    Method("zocurv-line", "zo-curv", "AdamW with per-block Newton multipliers along the last update (default)",
           build_zocurv_mode, LineOptions, _zocurv_line, probes_along_step=True),
    # Second generation (issue 17; trainer.zo.role_rules): knobs in RoleOptions, probe budget per refresh is
    # TrainConfig.probe_budget.
    Method("zocurv-group", "zo-curv", "AdamW with upward-only per-role multipliers from group curvature probes",
           build_zocurv_mode, RoleOptions, _zocurv_role),
    Method("zocurv-global", "zo-curv", "AdamW with an upward-only global multiplier from a multi-step line fit",
           build_zocurv_mode, RoleOptions, _zocurv_role, probes_along_step=True),
    Method("zocurv-group-global", "zo-curv", "zocurv-group and zocurv-global together", build_zocurv_mode,
           RoleOptions, _zocurv_role),
    Method("zocurv-group-fixed", "zo-curv", "ablation: Wang et al. 2025's per-role multipliers fixed, no probes",
           build_zocurv_mode, RoleOptions, _zocurv_role, needs_probes=False),
    # Issue 29 (trainer.zo.regime_mode): block-type lrs, static (zero probes) or from the calibrated trust region.
    Method("zocurv-static", "zo-curv", "AdamW with Wang et al. 2025's per-role lr table, normalised, no probes",
           build_regime_mode, RegimeOptions, fleet=False, needs_probes=False),
    Method("zocurv-trust", "zo-curv", "AdamW with per-role multipliers from a calibrated block trust region",
           build_regime_mode, RegimeOptions, fleet=False, probes_along_step=True,
           no_fleet_why="its group-line probes (trainer.zo.group_line) run in process only, in its own mode"),
    Method("mezo", "pure-zo", "MeZO: one Gaussian probe pair per step", build_pure_zo_mode,
           tasks=_LM_AND_SENTIMENT, sentiment_lr=1e-4),
    Method("1spsa", "pure-zo", "SPSA with K Rademacher probe pairs per step", build_pure_zo_mode,
           tasks=_LM_AND_SENTIMENT, sentiment_lr=1e-5),
    Method("1.5spsa", "pure-zo", "1.5-SPSA: K probes weighted by their curvature", build_pure_zo_mode,
           tasks=_LM_AND_SENTIMENT, sentiment_lr=1e-5),
)}


def get_method(name: str) -> Method:
    """The registered method `name`. Raises ValueError (listing the names) for an unknown one."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(METHODS)}") from None


def method_names(kind: Kind | None = None, task: str | None = None) -> tuple[str, ...]:
    """Registered names in table order, optionally only of one `kind` and/or runnable on `task`."""
    return tuple(m.name for m in METHODS.values()
                 if (kind is None or m.kind == kind) and (task is None or task in m.tasks))


def fleet_method_names(task: str | None = None) -> tuple[str, ...]:
    """Names whose probe rounds can go to a fleet (`sparecycles up`, `train --coordinator`), optionally on `task`."""
    return tuple(m.name for m in METHODS.values()
                 if m.needs_probes and m.fleet and (task is None or task in m.tasks))
