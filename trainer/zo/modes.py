"""Training-loop modes for the ZO methods, built through the registry (trainer.methods):

- `ZOCurvMode` (kind "zo-curv": every zocurv-* method): backprop on the training batch plus a curvature refresh
  every `curvature_interval` steps on the first `probe_batch_size` sequences of that batch; the optimizer (a
  trainer.zo.optimizers.CurvRule) comes from the method's `optimizer` factory (trainer.mode_builders.build_optimizer),
  the rounds' lifecycle is a trainer.zo.rounds.RoundBook;
- `PureZOMode` (kind "pure-zo": mezo, 1spsa, 1.5spsa): no backward, K probes per step on the whole batch.
Every mode implements trainer.modes.TrainMode (step / extra_state / load_extra_state).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.distributed import backward, whole
from trainer.models.losses import lm_batch_loss
from trainer.zo.backend import InProcessBackend, ProbeBackend
from trainer.zo.optimizers import CurvRule
from trainer.zo.rounds import RoundBook
from trainer.zo.zo_step import ZOStepper

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def backprop_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                  loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                  grad_clip: float) -> tuple[float, float]:
    """The first-order half of a ZO-Curv step: zero the grads, backprop loss_fn(model, batch), clip the global
    gradient norm to `grad_clip` (0: no clipping), step `opt`. Returns (loss in nats, pre-clip gradient norm).

    `batch` may be trainer.distributed.MicroBatches (`--micro-batch-size`): the gradient then accumulates over
    its parts (trainer.distributed.backward) and the loss is their mean, as AdamW's: the step sees the gradient
    of the whole batch, whatever the micro-batch size."""
    opt.zero_grad(set_to_none=True)
    loss = backward(model, loss_fn, batch)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    opt.step()
    return float(loss), float(gnorm)


def refresh(rule: CurvRule, book: RoundBook, backend: ProbeBackend, batch: Any, version: int) -> dict[str, float]:
    """One curvature refresh at `version` on `batch`: the rule's rounds issued, what is due collected and folded
    (trainer.zo.rounds), the rule's refresh scalars and (when rounds were issued or are pending) the book's
    counters. Raises ValueError when the backend's blocks differ from the rule's."""
    if list(backend.block_sizes) != list(rule.block_sizes):
        raise ValueError("backend blocks differ from the optimizer's: build both from the same model")
    if getattr(rule, "probe_source", None) is None and hasattr(rule, "attach_probe_source"):
        rule.attach_probe_source("refresh")  # its steps are curvature-shaped: no "acts as AdamW" warning
    rounds = rule.make_rounds(batch, version, backend.snapshots)
    stats: dict[str, float] = {}
    if rounds or book.inflight():
        book.issue(backend, rounds)
        book.collect(backend)
        for done in book.due(version):
            stats.update(rule.fold(done))
        stats.update(book.stats(rule.log_prefix))
    stats.update(rule.refresh_stats())
    return stats


def publish_version(book: RoundBook, backend: ProbeBackend, version: int) -> dict[str, float]:
    """Publish the weights as `version` for the rule's rounds (the book settles what must precede it first);
    returns `publish_s` (the trainer's seconds: on a fleet the upload follows in the background), `publish_unix`,
    `publish_version`. ZOCurvMode and trainer.zo.wrapper.ZOCurvWrapper both publish through it."""
    book.before_publish(backend, version)
    t0, unix0 = time.perf_counter(), time.time()
    backend.publish(version)
    return {"publish_s": time.perf_counter() - t0, "publish_unix": unix0, "publish_version": float(version)}


class ZOCurvMode:
    """Backprop step with a ZO-Curv optimizer; a curvature refresh every `curvature_interval` steps.

    Per step: publish θ_step when the rule's rounds probe it (`CurvRule.publishes`; figures `publish_s`,
    `publish_unix`, `publish_version`: on a fleet the trainer's share, the upload following in the background),
    refresh on refresh steps (`refresh`), then the backprop step. Logged per step: loss, grad_norm, clipped_frac,
    forward_passes (training + probe forwards), probe_forwards, probe_wall_s (seconds in refreshes, cumulative);
    on refresh steps the rule's scalars and the round counters `<log_prefix>_accepted|stale|...`.

    Args: cfg, model, optimizer (the method's CurvRule over `model`'s canonical blocks: build through
    trainer.mode_builders.build_mode), loss_fn(model, batch) -> scalar; backend: where rounds run (None: in process on
    `model`); timing: when rounds fold (trainer.zo.rounds.FOLD_TIMINGS).
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, optimizer: CurvRule,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_batch_loss,
                 backend: ProbeBackend | None = None, timing: str = "async") -> None:
        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
        self.optimizer = optimizer
        if hasattr(optimizer, "attach_probe_source"):  # its refreshes feed the curvature (a resume may step first)
            optimizer.attach_probe_source("ZOCurvMode")
        self.backend = backend or InProcessBackend(model, loss_fn, history=self.optimizer.history,
                                                   staleness=cfg.staleness)
        self.rounds = RoundBook(cfg.staleness, timing)
        self.train_forwards = 0
        self.probe_wall_s = 0.0
        # Over a fleet (a backend evaluating published versions) a resume re-issues the rounds in flight: the
        # weights they probe are held here (references to the backend's snapshots) for the checkpoint.
        self.round_weights: dict[int, list[torch.Tensor]] = {}
        self.next_step: int | None = None  # the step after the last completed one (None before any)

    def _probe_batch(self, batch: Any) -> Any:
        """The refresh's probe batch: the first `probe_batch_size` sequences of the step's batch (of this rank's
        shard under torchrun; micro-batches joined first, so accumulation probes the same rows)."""
        batch = whole(batch)
        if isinstance(batch, tuple) and all(isinstance(t, torch.Tensor) for t in batch):
            return tuple(t[: self.cfg.probe_batch_size] for t in batch)
        return batch

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Optimizer step `step` (= weight version before it) on `batch`; returns logged scalars."""
        opt = self.optimizer
        for g in opt.param_groups:
            g["lr"] = lr
        stats: dict[str, float] = {}
        # A step retried after a resume may find its version published already (the checkpoint was taken after
        # that publish, when the step's refresh failed): the weights are the same, publish once.
        if opt.publishes(step, self.cfg.curvature_interval) and step not in self.backend.snapshots:
            stats.update(self._publish(step))
        if step % self.cfg.curvature_interval == 0:
            t0 = self._clock()
            try:
                stats.update(refresh(opt, self.rounds, self.backend, self._probe_batch(batch), step))
            finally:  # also when the refresh is cut (a stop while it waits: trainer.console.StopWaiting; a fleet
                # unreachable): the checkpoint of the steps before it then holds the weights of the rounds it issued,
                # and the resume re-issues them as in flight (load_extra_state) for the retried step to fold
                if self.backend.evaluates_published:
                    self._hold_round_weights()
            self.probe_wall_s += self._clock() - t0
        loss, gnorm = backprop_step(self.model, opt, self.loss_fn, batch, self.cfg.grad_clip)
        self.train_forwards += 1
        probe_forwards = self.backend.forward_passes
        stats.update({"loss": loss, "grad_norm": gnorm, "clipped_frac": opt.last_clipped_frac,
                      "forward_passes": float(self.train_forwards + probe_forwards),
                      "probe_forwards": float(probe_forwards), "probe_wall_s": self.probe_wall_s})
        self.next_step = step + 1
        return stats

    def _publish(self, version: int) -> dict[str, float]:
        return publish_version(self.rounds, self.backend, version)

    def _clock(self) -> float:
        """Seconds, after the device's queued work finished (probe time is GPU time on CUDA)."""
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def _hold_round_weights(self) -> None:
        """Keep the published weights (fp32 canonical blocks) of every version a round in flight probes."""
        need = {v for r in self.rounds.inflight() for v in (r.version, r.base_version) if v is not None}
        have = {**self.round_weights, **self.backend.snapshots}
        self.round_weights = {v: have[v] for v in need if v in have}

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The rule's state and the round book's (trainer.zo.rounds: counters, rounds in flight with their batches
        and results taken) as `curvature`, the forward counts, and the weights the rounds probe.

        A rule whose rounds probe along θ_v − θ_base (`history` > 0) also keeps its newest published snapshot:
        the first round after a resume probes exactly as an uninterrupted run would. Weights as
        `line_prev/<block>` and `round_weights/<version>/<block>` (fp32).
        """
        tensors, meta = self.optimizer.zo_state()
        book_tensors, book_meta = self.rounds.state()
        tensors.update(book_tensors)
        meta = {"curvature": {**meta, **book_meta}, "train_forwards": self.train_forwards,
                "probe_forwards": self.backend.forward_passes}
        # A checkpoint taken after a step that failed midway holds the weights before it: a version that step
        # published is the retried step's to publish again (its refresh then probes along θ_v − θ_base).
        done = [v for v in self.backend.snapshots if self.next_step is None or v < self.next_step]
        if self.optimizer.history and done:
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
        self.rounds.load_state(tensors, meta["curvature"])
        self.train_forwards = int(meta.get("train_forwards", 0))
        self.backend.forward_passes = int(meta.get("probe_forwards", 0))
        n = len(self.backend.block_sizes)
        dev = next(self.model.parameters()).device  # checkpoints load on the CPU; rounds subtract model-side weights
        weights = {int(v): [tensors[f"round_weights/{v}/{i}"].to(dev) for i in range(n)]
                   for v in meta.get("round_weights", [])}
        prev = meta.get("line_prev_version")
        if self.optimizer.history and prev is not None:
            weights[int(prev)] = [tensors[f"line_prev/{i}"].to(dev) for i in range(n)]
        rounds = self.rounds.inflight()
        fleet = self.backend.evaluates_published
        if not fleet or any(v not in weights for r in rounds for v in (r.version, r.base_version) if v is not None):
            self.rounds.drop_inflight()
            rounds = []
        if not fleet:
            if prev is not None and self.optimizer.history:
                self.backend.snapshots = {int(prev): weights[int(prev)]}
            return
        for v in sorted(weights):
            self.backend.publish_weights(v, weights[v])
            for r in (r for r in rounds if r.version == v):
                self.rounds.take_early(self.backend, r)
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
