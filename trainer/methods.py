"""The registry of training methods: every `--optimizer` name, what kind it is and which knobs it has.

One table (`METHODS`) replaces the name lists that used to be spread over the config, the CLIs, the
training modes and the benchmarks: `TrainConfig` validates `optimizer`/`optimizer_options` against it,
the CLIs take their choices from it, trainer.mode_builders builds through it.

Adding a method (e.g. a new ZO-Curv variant) is one entry in `METHODS` below:

    Method("zocurv-foo", "zo-curv", "one line for --help", options=FooOptions)

`options` (a frozen pydantic model of the method's own knobs, with defaults) also names its ZO-Curv optimizer:
trainer.mode_builders.OPTIMIZERS maps each options class to the factory that reads it, and the loop mode comes
from the kind (trainer.mode_builders.BUILDERS); a new options class is one entry there. `TrainConfig.optimizer_options`
(CLI: `--optimizer-option KEY=VALUE`) overrides their defaults and is validated by that model. Run-wide knobs
(lr, probes, eps, staleness, curvature_interval, ...) stay in TrainConfig.

This module imports only pydantic and the standard library, and nothing that imports the config: the config
loads it at import time, and the builders (which take a config) live in trainer.mode_builders, so no import
circle runs through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.method_options import (  # noqa: F401  (MethodOptions: public here too)
    BlockOptions,
    LineOptions,
    MethodOptions,
    RegimeOptions,
    RoleOptions,
    SophiaOptions,
)

Kind = Literal["first-order", "zo-curv", "pure-zo"]
KINDS: tuple[Kind, ...] = ("first-order", "zo-curv", "pure-zo")


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: the `--optimizer` value.
        kind: "first-order" (backprop only), "zo-curv" (backprop step shaped by curvature from probe
            rounds) or "pure-zo" (forward passes only: every step is a probe round).
        summary: one line for --help and the README.
        options: pydantic model of the method's own knobs (defaults = the tuned values); for zo-curv methods it
            also picks the optimizer factory (trainer.mode_builders.OPTIMIZERS).
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
    Raises ValueError (at definition) for an unknown kind.
    """

    name: str
    kind: Kind
    summary: str
    options: type[MethodOptions] = MethodOptions
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
        if self.needs_probes and not self.fleet and not self.no_fleet_why:
            raise ValueError(f"method {self.name!r}: say why its probes cannot go to a fleet (`no_fleet_why`)")

    def parse_options(self, given: dict[str, Any] | None = None) -> MethodOptions:
        """The method's options with `given` overriding the defaults. Raises pydantic.ValidationError."""
        return self.options(**(given or {}))


# ---- the table -----------------------------------------------------------------------------------------
_LM_AND_SENTIMENT = ("lm", "sentiment")

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("adamw", "first-order", "backprop AdamW, the baseline",
           tasks=_LM_AND_SENTIMENT, sentiment_lr=2e-4),
    Method("zocurv-block", "zo-curv", "AdamW with per-block multipliers from block-scaled probe curvature",
           BlockOptions),
    Method("zocurv-sophia", "zo-curv", "Sophia's clipped step with ZO curvature (per block or coordinate)",
           SophiaOptions),
    Method("zocurv-line", "zo-curv", "AdamW with per-block Newton multipliers along the last update (default)",
           LineOptions, probes_along_step=True),
    # Second generation (trainer.zo.role_rules): knobs in RoleOptions, probe budget per refresh is
    # TrainConfig.probe_budget.
    Method("zocurv-group", "zo-curv", "AdamW with upward-only per-role multipliers from group curvature probes",
           RoleOptions),
    Method("zocurv-global", "zo-curv", "AdamW with an upward-only global multiplier from a multi-step line fit",
           RoleOptions, probes_along_step=True),
    Method("zocurv-group-global", "zo-curv", "zocurv-group and zocurv-global together", RoleOptions),
    Method("zocurv-group-fixed", "zo-curv", "ablation: Wang et al. 2025's per-role multipliers fixed, no probes",
           RoleOptions, needs_probes=False),
    # Regimes (trainer.zo.regime_mode): block-type lrs, static (zero probes) or from the calibrated trust region.
    Method("zocurv-static", "zo-curv", "AdamW with Wang et al. 2025's per-role lr table, normalised, no probes",
           RegimeOptions, needs_probes=False),
    Method("zocurv-trust", "zo-curv", "AdamW with per-role multipliers from a calibrated block trust region",
           RegimeOptions, probes_along_step=True, probes_after_warmup=True),
    Method("mezo", "pure-zo", "MeZO: one Gaussian probe pair per step",
           tasks=_LM_AND_SENTIMENT, sentiment_lr=1e-4),
    Method("1spsa", "pure-zo", "SPSA with K Rademacher probe pairs per step",
           tasks=_LM_AND_SENTIMENT, sentiment_lr=1e-5),
    Method("1.5spsa", "pure-zo", "1.5-SPSA: K probes weighted by their curvature",
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
