"""Training-loop mode of the block-type lr methods of issue 29: AdamW (ScaledAdamW) at per-role multipliers.

- ``zocurv-static``: Wang et al.'s table, fixed, no probes (trainer.zo.block_table; normalised by its
  parameter-weighted geometric mean by default, so the base lr means what AdamW's does).
- ``zocurv-trust``: the calibrated block trust region (trainer.zo.trust_region): every `curvature_interval`
  steps, per role, the loss along that role's share of θ_t − θ_prev (trainer.zo.group_line) at
  DESIGN_ALPHAS on `batches` held-out batches of `probe_batch_size` sequences; the multipliers start at the
  static table (option start="table") or at 1 (start="one") and move only after `agree` consecutive
  refreshes with |z| > `z_min` of one sign. Folding starts after warmup (the lr still rises there, so
  "longer steps" is what every fit would say). Probes run in process on the trainer's model.

Held-out probe batches: random windows (seed stream TAG_PROBE, one index per refresh and batch) of the
corpus's selection split when it has one (`Corpus.select`: the split that chooses, never the one reported;
classics-large has it), else of its validation split; the reported validation loss reads a fixed evenly spaced subset of
the same split, so on a corpus without a selection split the fits may see some of those windows (they choose
R ≈ 5 scalars per refresh).
Logged on refresh steps: mult_<role>; when fitted also tr_r_<role> (exp of the mean log-ratio), tr_z_<role>,
tr_streak_<role>; every step probe_forwards, probe_wall_s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.method_options import RegimeOptions
from trainer.zo import estimators as est
from trainer.zo.block_table import table_multipliers
from trainer.zo.group_line import group_line_losses
from trainer.zo.groups import Role, block_multipliers, model_roles
from trainer.zo.modes import backprop_step
from trainer.zo.role_rules import ScaledAdamW
from trainer.zo.trust_region import DESIGN_ALPHAS, TrustRegion, TrustRegionRule, fit_role

if TYPE_CHECKING:
    from trainer.config import TrainConfig

REGIME_METHODS = ("zocurv-static", "zocurv-trust")
TAG_PROBE = 0x7E61  # seed stream of the held-out probe batches


class BlockRegimeMode:
    """Backprop AdamW with per-role lr multipliers, static or from the trust region (module docstring).

    Args: cfg (optimizer one of REGIME_METHODS), model (fp32), loss_fn(model, batch) -> scalar; backend: must be
    None (probes run in process). probe_source(refresh, b) -> batch: the held-out batches (default: the
    corpus's selection or validation split, module docstring). Raises ValueError for another optimizer, a
    backend, or a model trainer.zo.groups cannot assign.
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], backend: Any = None,
                 probe_source: Callable[[int, int], Any] | None = None) -> None:
        if cfg.optimizer not in REGIME_METHODS:
            raise ValueError(f"{cfg.optimizer!r} is not one of {REGIME_METHODS}")
        if backend is not None:
            raise ValueError(f"{cfg.optimizer} probes in process only (no fleet probe kind carries role segments)")
        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
        self.opts = RegimeOptions(**cfg.optimizer_options)  # the registry's parse_options (trainer.methods)
        self.gmap = model_roles(model)
        canonical = [p for _, p in model.named_parameters()]
        groups = [{"params": [p for p in canonical if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in canonical if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = ScaledAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=canonical)
        self.table = table_multipliers(self.gmap, norm=self.opts.norm)
        start = self.table if cfg.optimizer == "zocurv-static" or self.opts.start == "table" else {
            r: 1.0 for r in self.gmap.roles}
        o = self.opts
        self.trust = cfg.optimizer == "zocurv-trust"
        self.region: TrustRegion[Role] = TrustRegion(dict(start), TrustRegionRule(
            beta=o.beta, z_min=o.z_min, agree=o.agree, r_min=o.r_min, r_max=o.r_max, m_min=o.m_min, m_max=o.m_max))
        self.probe_source = probe_source or (self._held_out_source() if self.trust else None)
        self.prev: list[torch.Tensor] | None = None  # fp32 θ at the last refresh (zocurv-trust)
        self.train_forwards = self.probe_forwards = 0
        self.probe_wall_s = 0.0
        self._apply()

    def _held_out_source(self) -> Callable[[int, int], Any]:
        from trainer.data import get_batch, load_corpus

        corpus = load_corpus(self.cfg.corpus)
        tokens = corpus.val if corpus.select is None else corpus.select
        cfg = self.cfg

        def source(refresh: int, b: int) -> Any:
            x, y = get_batch(tokens, cfg.probe_batch_size, cfg.seq_len, est.derive_seed(cfg.seed, TAG_PROBE),
                             refresh * self.opts.batches + b)
            return x.to(cfg.device), y.to(cfg.device)

        return source

    @property
    def mult(self) -> dict[Role, float]:
        """The current per-role multipliers."""
        return self.region.mult

    def _apply(self) -> None:
        devices = [p.device for p in self.model.parameters()]
        self.optimizer.block_mult = block_multipliers(self.gmap, self.region.mult, devices)

    def _clock(self) -> float:
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def refresh(self, step: int) -> dict[str, float]:
        """At a refresh step: fit and fold (after warmup, given θ_prev), then keep θ_step as the next θ_prev."""
        stats: dict[str, float] = {}
        if self.prev is not None and step >= self.cfg.warmup_steps:
            t0 = self._clock()
            refresh = step // self.cfg.curvature_interval
            batches = [self.probe_source(refresh, b) for b in range(self.opts.batches)]
            losses, fwd = group_line_losses(self.model, self.loss_fn, batches, self.gmap, self.prev, DESIGN_ALPHAS)
            self.probe_forwards += fwd
            fits = {r: fit_role(DESIGN_ALPHAS, v, r_min=self.opts.r_min, r_max=self.opts.r_max)
                    for r, v in losses.items()}
            self.region.update(fits)
            self._apply()
            for r, f in fits.items():
                stats.update({f"tr_r_{r.value}": math.exp(f.log_ratio), f"tr_z_{r.value}": max(min(f.z, 1e12), -1e12),
                              f"tr_streak_{r.value}": float(self.region.streak.get(r, 0))})
            self.probe_wall_s += self._clock() - t0
        self.prev = [p.detach().float().clone() for p in self.model.parameters()]
        return stats

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Optimizer step `step` on `batch` at base lr `lr`; a refresh first every `curvature_interval` steps."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        stats: dict[str, float] = {}
        if step % self.cfg.curvature_interval == 0:
            if self.trust:
                stats.update(self.refresh(step))
            stats.update({f"mult_{r.value}": float(v) for r, v in self.region.mult.items()})
        loss, gnorm = backprop_step(self.model, self.optimizer, self.loss_fn, batch, self.cfg.grad_clip)
        self.train_forwards += 1
        stats.update({"loss": loss, "grad_norm": gnorm, "clipped_frac": 0.0,
                      "forward_passes": float(self.train_forwards + self.probe_forwards),
                      "probe_forwards": float(self.probe_forwards), "probe_wall_s": self.probe_wall_s})
        return stats

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Multipliers, streaks and counters (JSON); θ_prev (tensors) when held."""
        tensors = {f"tr_prev/{i}": t for i, t in enumerate(self.prev or [])}
        meta = {**self.region.state(), "train_forwards": self.train_forwards, "probe_forwards": self.probe_forwards,
                "probe_wall_s": self.probe_wall_s, "has_prev": self.prev is not None}
        return tensors, meta

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `extra_state()`: the resumed run refreshes exactly as an uninterrupted one would."""
        self.region.mult = {Role(k): float(v) for k, v in meta["mult"].items()}
        self.region.streak = {Role(k): int(v) for k, v in meta["streak"].items()}
        self.train_forwards, self.probe_forwards = int(meta["train_forwards"]), int(meta["probe_forwards"])
        self.probe_wall_s = float(meta.get("probe_wall_s", 0.0))
        if meta.get("has_prev"):
            dev = next(self.model.parameters()).device  # checkpoints load on the CPU
            self.prev = [tensors[f"tr_prev/{i}"].to(dev) for i in range(len(list(self.model.parameters())))]
        self._apply()
