"""The registry of training methods: every `--optimizer` name, what kind it is and how to build it.

One table (`METHODS`) replaces the name lists that used to be spread over the config, the CLIs, the
training modes and the benchmarks: `TrainConfig` validates `optimizer`/`optimizer_options` against it,
the CLIs take their choices from it, `build_mode` builds through it.

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

from pydantic import BaseModel

from trainer.method_options import (  # noqa: F401  (MethodOptions: public here too)
    BlockOptions,
    LineOptions,
    MethodOptions,
    RegimeOptions,
    RoleOptions,
    SophiaOptions,
)

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
            ZO-Curv torch optimizer, a trainer.zo.optimizers.CurvRule.
        tasks: the `--task` values it runs on.
        fleet: whether its probe rounds can go to a fleet backend (`sparecycles up`); False: in process only.
        no_fleet_why: for a method with probes and fleet=False, why (`train --coordinator` / `up` say it).
        needs_probes: whether it evaluates probe rounds at all (default: kind != "first-order"; False for a
            zero-probe ablation).
        probes_along_step: its rounds probe along θ_s − θ_{s−k}, which needs an earlier version: the first round
            is at step k = curvature_interval, not 0 (trainer.preflight.probe_rounds).
        probes_after_warmup: it sends no round before step warmup_steps (zocurv-trust: fits during warmup would all
            ask for longer steps).
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
    probes_after_warmup: bool = False

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


# ---- builders (lazy imports: this module stays torch-free; the modes import nothing of it) ------------------
def build_mode(cfg, model, loss_fn=None, backend=None, timing="async"):
    """The step strategy (a trainer.modes.TrainMode) of `cfg.optimizer` on `loss_fn` (default: the causal-LM
    loss), built by its registered builder. `backend` evaluates probe rounds (default: in process on `model`;
    `sparecycles up` passes the fleet's CoordinatorBackend); first-order methods ignore it. `timing`: when ZO-Curv
    rounds fold (trainer.zo.rounds.FOLD_TIMINGS). The method/task pairing is checked by TrainConfig.
    Raises ValueError for an unregistered name.
    """
    if loss_fn is None:
        from trainer.models.losses import lm_batch_loss as loss_fn
    return get_method(cfg.optimizer).build(cfg, model, loss_fn, backend, timing)


def build_first_order_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """Backprop AdamW (trainer.modes.AdamWMode); `backend` and `timing` are unused."""
    from trainer.modes import AdamWMode

    return AdamWMode(model, cfg, loss_fn)


def build_optimizer(cfg, model):
    """The ZO-Curv optimizer (a trainer.zo.optimizers.CurvRule) of `cfg.optimizer` from its registered factory,
    weight decay on matrices only (as AdamWMode), blocks in canonical order. Raises ValueError for a method
    without a factory."""
    from trainer.zo.probes import canonical_blocks

    method = get_method(cfg.optimizer)
    if method.optimizer is None:
        raise ValueError(f"{cfg.optimizer!r} is not a ZO-Curv optimizer (its kind is {method.kind})")
    canonical = canonical_blocks(model)
    params = [b.param for b in canonical]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return method.optimizer(groups, canonical, cfg, method.parse_options(cfg.optimizer_options))


def build_zocurv_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """Backprop with a ZO-Curv optimizer (the method's `optimizer` factory) and periodic probe rounds."""
    from trainer.zo.modes import ZOCurvMode

    return ZOCurvMode(cfg, model, build_optimizer(cfg, model), loss_fn, backend, timing)


def build_pure_zo_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """MeZO / 1SPSA / 1.5-SPSA (trainer.zo.modes.PureZOMode), K probes per step."""
    from trainer.zo.modes import PureZOMode

    return PureZOMode(cfg, model, loss_fn, backend)


# ---- ZO-Curv variants ----------------------------------------------------------------------------------
def _zocurv_common(blocks, cfg) -> dict[str, Any]:
    return {"blocks": [b.param for b in blocks], "probe_eps": cfg.eps, "seed": cfg.seed}


def _zocurv_block(groups, blocks, cfg, o: BlockOptions):
    from trainer.zo.optimizers import ZOCurvBlockAdamW

    return ZOCurvBlockAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), probes=cfg.probes, rho=o.rho,
                            s_min=o.s_min, s_max=o.s_max, curv_beta=o.curv_beta, **_zocurv_common(blocks, cfg))


def _zocurv_sophia(groups, blocks, cfg, o: SophiaOptions):
    from trainer.zo.optimizers import ZOCurvSophia

    return ZOCurvSophia(groups, lr=cfg.lr, betas=(cfg.beta1, o.beta2), gamma=o.gamma, granularity=o.granularity,
                        probes=cfg.probes, **_zocurv_common(blocks, cfg))


def _zocurv_line(groups, blocks, cfg, o: LineOptions):
    from trainer.zo.optimizers import ZOCurvLine

    return ZOCurvLine(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), s_min=o.s_min, s_max=o.s_max,
                      r_min=o.r_min, r_max=o.r_max, curv_beta=o.curv_beta, **_zocurv_common(blocks, cfg))


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


def _zocurv_regime(groups, blocks, cfg, o: RegimeOptions):
    from trainer.zo.regime_mode import build_regime_rule

    return build_regime_rule(groups, blocks, cfg, o)


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
           build_zocurv_mode, RegimeOptions, _zocurv_regime, needs_probes=False),
    Method("zocurv-trust", "zo-curv", "AdamW with per-role multipliers from a calibrated block trust region",
           build_zocurv_mode, RegimeOptions, _zocurv_regime, probes_along_step=True, probes_after_warmup=True),
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
