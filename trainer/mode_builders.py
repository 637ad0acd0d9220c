"""Builders of the training modes: a TrainConfig -> its method's loop mode (trainer.modes.TrainMode) and, for the
ZO-Curv methods, its optimizer.

The registry (trainer.methods) says what each `--optimizer` name is; this module says how it is built: the mode by
the method's kind (BUILDERS), the ZO-Curv optimizer by the method's options class (OPTIMIZERS: each options model
is read by one factory). It imports the config and the modes, which import nothing of it (no import circle; the
config imports only the registry). Builders import torch and the optimizers inside their bodies so that
importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from trainer.methods import (
    BlockOptions,
    Kind,
    LineOptions,
    RegimeOptions,
    RoleOptions,
    SophiaOptions,
    get_method,
)

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainConfig
    from trainer.zo.backend import ProbeBackend
    from trainer.zo.probes import Block

# build(cfg, model, loss_fn, backend, timing) -> a trainer.modes.TrainMode. backend: where probe rounds go (None:
# in process on `model`); timing: when ZO-Curv rounds fold (trainer.zo.rounds.FOLD_TIMINGS). First-order methods
# ignore both, pure-ZO methods the timing (their steps wait for their rounds).
Builder = Callable[["TrainConfig", "torch.nn.Module", Callable[..., Any], "ProbeBackend | None", str], Any]
# optimizer(param_groups, blocks, cfg, options) -> a trainer.zo.optimizers.CurvRule torch optimizer (zo-curv only);
# blocks: the model's canonical blocks (trainer.zo.probes.Block: name, parameter, offset), in order.
OptimizerFactory = Callable[[list[dict], list["Block"], "TrainConfig", BaseModel], Any]


def build_mode(cfg, model, loss_fn=None, backend=None, timing="async"):
    """The step strategy (a trainer.modes.TrainMode) of `cfg.optimizer` on `loss_fn` (default: the causal-LM
    loss), built by its registered builder. `backend` evaluates probe rounds (default: in process on `model`;
    `sparecycles up` passes the fleet's CoordinatorBackend); first-order methods ignore it. `timing`: when ZO-Curv
    rounds fold (trainer.zo.rounds.FOLD_TIMINGS). The method/task pairing is checked by TrainConfig.
    Raises ValueError for an unregistered name.
    """
    if loss_fn is None:
        from trainer.models.losses import lm_batch_loss as loss_fn
    return BUILDERS[get_method(cfg.optimizer).kind](cfg, model, loss_fn, backend, timing)


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
    if method.kind != "zo-curv":
        raise ValueError(f"{cfg.optimizer!r} is not a ZO-Curv optimizer (its kind is {method.kind})")
    canonical = canonical_blocks(model)
    params = [b.param for b in canonical]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return OPTIMIZERS[method.options](groups, canonical, cfg, method.parse_options(cfg.optimizer_options))


def build_zocurv_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """Backprop with a ZO-Curv optimizer (the factory of the method's options, OPTIMIZERS) and periodic probe rounds."""
    from trainer.zo.modes import ZOCurvMode

    return ZOCurvMode(cfg, model, build_optimizer(cfg, model), loss_fn, backend, timing)


def build_pure_zo_mode(cfg, model, loss_fn, backend=None, timing="async"):
    """MeZO / 1SPSA / 1.5-SPSA (trainer.zo.modes.PureZOMode), K probes per step."""
    from trainer.zo.modes import PureZOMode

    return PureZOMode(cfg, model, loss_fn, backend)


# ---- ZO-Curv variants ----------------------------------------------------------------------------------
def _probing(cfg):
    from trainer.zo.optimizers import Probing

    return Probing(probes=cfg.probes, probe_eps=cfg.eps, seed=cfg.seed)


def _zocurv_block(groups, blocks, cfg, o: BlockOptions):
    from trainer.zo.optimizers import ZOCurvBlockAdamW

    return ZOCurvBlockAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=[b.param for b in blocks],
                            options=o, probing=_probing(cfg))


def _zocurv_sophia(groups, blocks, cfg, o: SophiaOptions):
    from trainer.zo.optimizers import ZOCurvSophia

    return ZOCurvSophia(groups, lr=cfg.lr, betas=(cfg.beta1, o.beta2), gamma=o.gamma, granularity=o.granularity,
                        blocks=[b.param for b in blocks], probing=_probing(cfg))


def _zocurv_line(groups, blocks, cfg, o: LineOptions):
    from trainer.zo.optimizers import ZOCurvLine

    return ZOCurvLine(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=[b.param for b in blocks], options=o,
                      probe_eps=cfg.eps, seed=cfg.seed)


def _zocurv_role(groups, blocks, cfg, o: RoleOptions):
    from trainer.zo.groups import assign_roles
    from trainer.zo.role_rules import RoleRounds, ZOCurvRoleAdamW

    return ZOCurvRoleAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=[b.param for b in blocks],
                           gmap=assign_roles([(b.name, b.param) for b in blocks]), options=o,
                           rounds=RoleRounds.of(cfg))


def _zocurv_regime(groups, blocks, cfg, o: RegimeOptions):
    from trainer.zo.regime_mode import build_regime_rule

    return build_regime_rule(groups, blocks, cfg, o)


BUILDERS: dict[Kind, Builder] = {"first-order": build_first_order_mode, "zo-curv": build_zocurv_mode,
                                 "pure-zo": build_pure_zo_mode}
OPTIMIZERS: dict[type[BaseModel], OptimizerFactory] = {
    BlockOptions: _zocurv_block, SophiaOptions: _zocurv_sophia, LineOptions: _zocurv_line, RoleOptions: _zocurv_role,
    RegimeOptions: _zocurv_regime,
}
