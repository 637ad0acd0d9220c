"""Training-loop mode of the second-generation ZO-Curv variants (DESIGN.md §2 (d), (e); issue 17).

- ``zocurv-group``: per-role lr multipliers from group-restricted curvature probes (trainer.zo.role_adamw)
  every `curvature_interval` steps, on the first `probe_batch_size` sequences of the step's batch before
  it is trained on (fresh for θ_t). Probe budget per refresh = `probe_budget` forward-equivalents: one
  clean pass + 2 per probe, K = (budget − 1) // (2·roles) probes per role (at least 2 for an SNR).
- ``zocurv-global``: a global upward-only multiplier from a quadratic fit along θ_t − θ_{t−k},
  k = `curvature_interval`, at LINE_ALPHAS (α = −1 is θ_{t−k}; 5 forward passes per refresh).
- ``zocurv-group-global``: both.
- ``zocurv-group-fixed``: the zero-probe ablation, WANG2025_MULTIPLIERS fixed from step 0.
`eps` is relative for these modes: ε_G = eps·RMS(θ_G). Logged on refresh steps: ``mult_<role>``,
``curv_<role>``, ``snr_<role>``, ``mult_global``, ``line_snr``, ``line_ratio``; every step ``probe_forwards`` and ``probe_wall_s`` (cumulative).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.zo.groups import Role, block_multipliers, model_roles
from trainer.zo.modes import backprop_step
from trainer.zo.multipliers import (
    WANG2025_MULTIPLIERS,
    line_ratio,
    quadratic_fit,
    update_global_multiplier,
    update_group_multipliers,
)
from trainer.zo.role_adamw import RoleAdamW, group_curvatures, line_losses

ROLE_METHODS = ("zocurv-group", "zocurv-global", "zocurv-group-global", "zocurv-group-fixed")
LINE_ALPHAS = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
# Multiplier knobs: trainer.methods.RoleOptions (--optimizer-option KEY=VALUE). Defaults: γ = ½ equalises the
# second-order cost of a sign-like step across groups (trainer.zo.multipliers); s_max = 10 is the top of
# Wang et al.'s table; refreshes with |SNR| < 2 leave a group's multiplier as it was.


class RoleCurvMode:
    """Backprop AdamW (RoleAdamW) whose per-role / global lr multipliers come from ZO probes (module docstring).

    Args: cfg (optimizer one of ROLE_METHODS), model (fp32), loss_fn(model, batch) -> scalar.
    Raises ValueError for another optimizer name or a model trainer.zo.groups cannot assign.
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
        if cfg.optimizer not in ROLE_METHODS:
            raise ValueError(f"{cfg.optimizer!r} is not one of {ROLE_METHODS}")
        from trainer.methods import get_method

        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
        self.opts = get_method(cfg.optimizer).parse_options(cfg.optimizer_options)
        self.gmap = model_roles(model)
        canonical = [p for _, p in model.named_parameters()]
        groups = [{"params": [p for p in canonical if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in canonical if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = RoleAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=canonical)
        name = cfg.optimizer
        self.group_probes = name in ("zocurv-group", "zocurv-group-global")
        self.line = name in ("zocurv-global", "zocurv-group-global")
        roles = self.gmap.roles
        self.mult = {r: 1.0 for r in roles}
        if name == "zocurv-group-fixed":
            self.mult = {r: WANG2025_MULTIPLIERS[r.value] for r in roles}
        self.per_role = max(2, (cfg.probe_budget - 1) // (2 * len(roles)))
        self.prev: list[torch.Tensor] | None = None  # θ at the last refresh (zocurv-global)
        self.train_forwards = self.probe_forwards = 0
        self.probe_wall_s = 0.0  # seconds spent probing (would run on idle workers)
        self._apply()

    def _apply(self) -> None:
        devices = [p.device for p in self.model.parameters()]
        self.optimizer.block_mult = block_multipliers(self.gmap, self.mult, devices)

    def _probe_batch(self, batch: Any) -> Any:
        if isinstance(batch, tuple) and all(isinstance(t, torch.Tensor) for t in batch):
            return tuple(t[: self.cfg.probe_batch_size] for t in batch)
        return batch

    def refresh(self, step: int, batch: Any) -> dict[str, float]:
        """Probe at θ_step on `batch` and update the multipliers; returns the logged scalars."""
        t0 = self._clock()
        stats: dict[str, float] = {}
        refresh = step // self.cfg.curvature_interval
        if self.group_probes:
            est, extra, fwd = group_curvatures(self.model, self.loss_fn, batch, self.gmap, probes=self.per_role,
                                               eps_rel=self.cfg.eps, seed=self.cfg.seed, refresh=refresh)
            self.probe_forwards += fwd
            o = self.opts
            self.mult = update_group_multipliers(self.mult, est, gamma=o.gamma, s_max=o.s_max, beta=o.group_beta,
                                                 snr_min=o.snr_min, negative=o.negative)
            self._apply()
            for r, e in est.items():
                # SE = 0 (exactly quadratic losses) gives an infinite SNR; keep the JSON log standard
                stats.update({f"curv_{r.value}": e.mean, f"snr_{r.value}": max(min(e.snr, 1e12), -1e12)})
            stats.update({k: v for k, v in extra.items() if k.startswith("eps_")})
        if self.line:
            params = list(self.model.parameters())
            if self.prev is not None:
                losses = line_losses(self.model, self.loss_fn, batch, self.prev, LINE_ALPHAS)
                self.probe_forwards += len(LINE_ALPHAS)
                fit = quadratic_fit(LINE_ALPHAS, losses)
                r = line_ratio(fit)
                self.optimizer.global_mult = update_global_multiplier(self.optimizer.global_mult, r,
                                                                      m_max=self.opts.m_max,
                                                                      beta=self.opts.global_beta)
                stats.update({"line_ratio": r, "line_snr": fit.snr if math.isfinite(fit.snr) else 0.0, "line_curv": fit.a, "line_slope": fit.b})
            self.prev = [p.detach().float().clone() for p in params]
        stats.update({f"mult_{r.value}": float(v) for r, v in self.mult.items()})
        stats["mult_global"] = self.optimizer.global_mult
        self.probe_wall_s += self._clock() - t0
        return stats

    def _clock(self) -> float:
        """Seconds, after the device's queued work finished (probe time is GPU time on CUDA)."""
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Optimizer step `step` on `batch` at base lr `lr`; a refresh first every `curvature_interval` steps."""
        opt = self.optimizer
        for g in opt.param_groups:
            g["lr"] = lr
        stats: dict[str, float] = {}
        if step % self.cfg.curvature_interval == 0:  # the fixed ablation logs its (constant) multipliers too
            stats.update(self.refresh(step, self._probe_batch(batch)))
        loss, gnorm = backprop_step(self.model, opt, self.loss_fn, batch, self.cfg.grad_clip)
        self.train_forwards += 1
        stats.update({"loss": loss, "grad_norm": gnorm, "clipped_frac": 0.0,
                      "forward_passes": float(self.train_forwards + self.probe_forwards),
                      "probe_forwards": float(self.probe_forwards), "probe_wall_s": self.probe_wall_s})
        return stats

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Multipliers and counters (JSON); θ at the last refresh (tensors) for zocurv-global."""
        tensors = {f"line_prev/{i}": t for i, t in enumerate(self.prev or [])}
        meta = {"mult": {r.value: v for r, v in self.mult.items()}, "global_mult": self.optimizer.global_mult,
                "train_forwards": self.train_forwards, "probe_forwards": self.probe_forwards,
                "has_prev": self.prev is not None}
        return tensors, meta

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `extra_state()`."""
        self.mult = {Role(k): float(v) for k, v in meta["mult"].items()}
        self.optimizer.global_mult = float(meta["global_mult"])
        self.train_forwards, self.probe_forwards = int(meta["train_forwards"]), int(meta["probe_forwards"])
        n = len(list(self.model.parameters()))
        self.prev = [tensors[f"line_prev/{i}"] for i in range(n)] if meta.get("has_prev") else None
        self._apply()
