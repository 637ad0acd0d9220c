"""Training-loop modes for the ZO methods, built through the registry (trainer.methods):

- `ZOCurvMode` (kind "zo-curv": zocurv-block, zocurv-sophia, zocurv-line, ...): backprop on the training
  batch plus a curvature probe round every `curvature_interval` steps on the first `probe_batch_size`
  sequences of that batch; the optimizer comes from the method's `optimizer` factory;
- `PureZOMode` (kind "pure-zo": mezo, 1spsa, 1.5spsa): no backward, K probes per step on the whole batch.
Every mode implements trainer.modes.TrainMode (step / extra_state / load_extra_state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.methods import get_method
from trainer.tasks import lm_batch_loss
from trainer.zo.backend import InProcessBackend, ProbeBackend
from trainer.zo.probes import ProbeKind, canonical_blocks
from trainer.zo.zo_step import ZOStepper


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The ZO-Curv optimizer of `cfg.optimizer` from its registered factory, weight decay on matrices only (as
    AdamWMode), blocks in canonical order. Raises ValueError for a method that is not of kind zo-curv."""
    method = get_method(cfg.optimizer)
    if method.optimizer is None:
        raise ValueError(f"{cfg.optimizer!r} is not a ZO-Curv optimizer (its kind is {method.kind})")
    canonical = [b.param for b in canonical_blocks(model)]
    groups = [{"params": [p for p in canonical if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in canonical if p.dim() < 2], "weight_decay": 0.0}]
    return method.optimizer(groups, canonical, cfg, method.parse_options(cfg.optimizer_options))



def backprop_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                  loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                  grad_clip: float) -> tuple[float, float]:
    """The first-order half of a ZO-Curv step: zero the grads, backprop loss_fn(model, batch), clip the global
    gradient norm to `grad_clip` (0: no clipping), step `opt`. Returns (loss in nats, pre-clip gradient norm)."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    opt.step()
    return loss.item(), float(gnorm)

class ZOCurvMode:
    """Backprop step with a ZO-Curv optimizer; a probe round every `curvature_interval` steps.

    Logged per step: loss, grad_norm, clipped_frac, forward_passes (training + probe forwards); on
    refresh steps also h mean/std/rounding noise, curvature spread and accepted/stale/duplicate counts.
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_batch_loss,
                 backend: ProbeBackend | None = None) -> None:
        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
        self.optimizer = build_optimizer(cfg, model)
        # Probes along the last update need the two weight versions around each refresh (zocurv-line).
        self.line = self.optimizer.kind is ProbeKind.ALONG_UPDATE
        self.backend = backend or InProcessBackend(model, loss_fn, history=2 if self.line else 0,
                                                   staleness=cfg.staleness)
        self.train_forwards = 0
        # A fleet backend (one that can publish given weights) lets a resume re-issue the rounds in flight: the
        # weights they probe are held here (references to the backend's snapshots) for the checkpoint.
        self.reissue = hasattr(self.backend, "publish_weights")
        self.round_weights: dict[int, list[torch.Tensor]] = {}
        self.next_step: int | None = None  # the step after the last completed one (None before any)

    def _probe_batch(self, batch: Any) -> Any:
        if isinstance(batch, tuple) and all(isinstance(t, torch.Tensor) for t in batch):
            return tuple(t[: self.cfg.probe_batch_size] for t in batch)
        return batch

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Optimizer step `step` (= weight version before it) on `batch`; returns logged scalars."""
        opt = self.optimizer
        for g in opt.param_groups:
            g["lr"] = lr
        stats: dict[str, float] = {}
        interval = self.cfg.curvature_interval
        due = step % interval == 0
        # zocurv-line probes along theta_v - theta_{v-1}: only the two versions around a refresh step are
        # needed, so publish just those (a fleet backend uploads every published version).
        # A step retried after a resume may find its version published already (the checkpoint was taken
        # after that publish, when the step's refresh failed): the weights are the same, publish once.
        if self.line and (due or (step + 1) % interval == 0) and step not in self.backend.snapshots:
            self.backend.publish(step)
        if due and (not self.line or step - 1 in self.backend.snapshots):
            stats.update(opt.refresh_curvature(self.backend, self._probe_batch(batch), version=step))
            if self.reissue:
                self._hold_round_weights()
        loss, gnorm = backprop_step(self.model, opt, self.loss_fn, batch, self.cfg.grad_clip)
        self.train_forwards += 1
        stats.update({"loss": loss, "grad_norm": gnorm, "clipped_frac": opt.last_clipped_frac,
                      "forward_passes": float(self.train_forwards + self.backend.forward_passes)})
        self.next_step = step + 1
        return stats

    def _hold_round_weights(self) -> None:
        """Keep the published weights (fp32 canonical blocks) of every version a round in flight probes."""
        need = {v for r in self.optimizer.inflight() for v in (r.version, r.base_version) if v is not None}
        have = {**self.round_weights, **self.backend.snapshots}
        self.round_weights = {v: have[v] for v in need if v in have}

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Curvature state tensors and JSON (optimizer moments/masters travel in the optimizer state), the
        rounds in flight (trainer.zo.optimizers: spec, batch, results taken) and the weights they probe.

        zocurv-line also keeps its newest published snapshot θ_{v−1}: the first round after a resume
        probes along θ_v − θ_{v−1} exactly as an uninterrupted run would. Weights as `line_prev/<block>` and
        `round_weights/<version>/<block>` (fp32).
        """
        tensors, meta = self.optimizer.zo_state()
        meta = {"curvature": meta, "train_forwards": self.train_forwards,
                "probe_forwards": self.backend.forward_passes}
        # A checkpoint taken after a step that failed midway holds the weights before it: a version that step
        # published is the retried step's to publish again (its refresh then probes along θ_v − θ_{v−1}).
        done = [v for v in self.backend.snapshots if self.next_step is None or v < self.next_step]
        if self.line and done:
            v = max(done)
            tensors.update({f"line_prev/{i}": t for i, t in enumerate(self.backend.snapshots[v])})
            meta["line_prev_version"] = v
        held = {v: w for v, w in self.round_weights.items() if v != meta.get("line_prev_version")}
        for v, w in held.items():
            tensors.update({f"round_weights/{v}/{i}": t for i, t in enumerate(w)})
        meta["round_weights"] = sorted(held)
        return tensors, meta

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `extra_state()`. Over a fleet (a new coordinator run, holding no version), publish the saved
        weights again and re-issue the rounds that were in flight, waiting for their results (up to the backend's
        round timeout) without folding them: they fold at the next refresh, as in the uninterrupted run, and no
        newer version is published before they are in, so none can arrive stale. In process (or a checkpoint
        without the weights) the rounds in flight are dropped and counted."""
        self.optimizer.load_zo_state(tensors, meta["curvature"])
        self.train_forwards = int(meta.get("train_forwards", 0))
        self.backend.forward_passes = int(meta.get("probe_forwards", 0))
        n = len(self.backend.block_sizes)
        dev = next(self.model.parameters()).device  # checkpoints load on the CPU; rounds subtract model-side weights
        weights = {int(v): [tensors[f"round_weights/{v}/{i}"].to(dev) for i in range(n)]
                   for v in meta.get("round_weights", [])}
        prev = meta.get("line_prev_version")
        if self.line and prev is not None:
            weights[int(prev)] = [tensors[f"line_prev/{i}"].to(dev) for i in range(n)]
        rounds = self.optimizer.inflight()
        if not self.reissue or any(v not in weights for r in rounds for v in (r.version, r.base_version)
                                   if v is not None):
            self.optimizer.drop_inflight()
            rounds = []
        if not self.reissue:
            if self.line and prev is not None:
                self.backend.snapshots = {int(prev): weights[int(prev)]}
            return
        for v in sorted(weights):
            self.backend.publish_weights(v, weights[v])
            for r in (r for r in rounds if r.version == v):
                self.backend.submit(r)
                self.optimizer.take_early(self.backend.collect(r.round_id))
        self.round_weights = weights
        self._hold_round_weights()


class PureZOMode:
    """MeZO / 1SPSA / 1.5-SPSA step (trainer.zo.zo_step.ZOStepper) through a ProbeBackend: in process by
    default; the fleet's fleet.backend.CoordinatorBackend under `sparecycles up` (LM or sentiment task), where each step's
    update travels to the workers as a seed-ledger entry."""

    optimizer = None

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_batch_loss,
                 backend: ProbeBackend | None = None) -> None:
        self.model = model
        self.backend = backend or InProcessBackend(model, loss_fn)
        self.stepper = ZOStepper(model, cfg.optimizer, run_seed=cfg.seed, probes=cfg.probes, eps=cfg.eps,
                                 alpha=cfg.alpha, lam=cfg.lam, weight_decay=cfg.weight_decay)

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """One pure-ZO step; returns loss, forward_passes and the estimator stats."""
        return self.stepper.step(step, batch, self.backend, lr)

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """fp32 masters (non-fp32 models) and the forward-pass count."""
        return self.stepper.state()

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `extra_state()`."""
        self.stepper.load_state(tensors, meta)
