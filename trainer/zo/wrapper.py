"""ZO-Curv as a plain torch.optim.Optimizer for any loop (sparecycles.loop.ZOCurv, sparecycles.hf.FleetCallback).

`ZOCurvWrapper` drives a ZO-Curv rule (a trainer.zo.optimizers.CurvRule: ZOCurvBlockAdamW, ZOCurvSophia, ... built
by the method registry, trainer.mode_builders.build_optimizer) the way trainer.zo.modes.ZOCurvMode does inside the CLI
trainer, with the same pieces: before the inner step of version v it publishes θ_v when the rule's rounds probe it,
(`trainer.zo.modes.publish_version`), runs `trainer.zo.modes.refresh` (issue the rule's rounds on the probe batch, collect, fold what is due through a
trainer.zo.rounds.RoundBook) every `curvature_interval` steps, then steps the rule on the gradients the loop
computed. The loop only adds `probe_batch(batch)` before `step()` (or a forward hook does it:
sparecycles.hf.FleetCallback). Param groups and state are the rule's own objects, so LR schedulers (and Hugging
Face's Trainer) act on the rule directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.mode_builders import build_optimizer
from trainer.models.losses import lm_batch_loss
from trainer.zo.backend import InProcessBackend, ProbeBackend
from trainer.zo.modes import publish_version, refresh
from trainer.zo.rounds import RoundBook


class ZOCurvWrapper(torch.optim.Optimizer):
    """torch.optim.Optimizer over a ZO-Curv rule with its probe rounds (module docstring).

    Args:
        model: the trained module (its canonical blocks are the rule's). rule: a CurvRule optimizer over them.
        loss_fn(model, batch) -> scalar: the probes' loss. backend: where rounds run (None: in process on `model`;
            a fleet's: fleet.attach.Fleet.probe_backend). interval: steps between curvature refreshes (>= 1).
        probe_batch_size: rows of the given batch the probes use. staleness: rounds older than this many versions
            are dropped. timing: when rounds fold (trainer.zo.rounds.FOLD_TIMINGS).
    `last_stats` holds the last step's refresh scalars (curvature spread, round counters). Raises ValueError for an
    interval < 1 or a backend whose blocks are not the rule's.
    """

    def __init__(self, model: torch.nn.Module, rule: Any, *, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 backend: ProbeBackend | None = None, interval: int = 10, probe_batch_size: int = 4,
                 staleness: int = 2, timing: str = "async") -> None:
        if interval < 1 or probe_batch_size < 1:
            raise ValueError(f"need interval >= 1 and probe_batch_size >= 1, got {interval}, {probe_batch_size}")
        self.model, self.rule, self.interval, self.probe_rows = model, rule, interval, probe_batch_size
        self.backend = backend or InProcessBackend(model, loss_fn, history=rule.history, staleness=staleness)
        if list(self.backend.block_sizes) != list(rule.block_sizes):
            raise ValueError("backend blocks differ from the optimizer's: build both from the same model")
        self.book = RoundBook(staleness, timing)
        if hasattr(rule, "attach_probe_source"):  # its refreshes come from this wrapper's steps
            rule.attach_probe_source("ZOCurvWrapper")
        # Optimizer's own bookkeeping (hooks) over the rule's very param-group dicts and state.
        super().__init__(rule.param_groups, rule.defaults)
        self.state = rule.state
        self.version = 0  # optimizer steps taken = the version the next step starts from
        self._probe: Any = None
        self.last_stats: dict[str, float] = {}

    def probe_batch(self, batch: Any) -> None:
        """The batch the next refresh probes: (x, y) int64 (B, T) for an LM (its first `probe_batch_size` rows)."""
        if isinstance(batch, tuple) and all(isinstance(t, torch.Tensor) for t in batch):
            batch = tuple(t[: self.probe_rows].detach() for t in batch)
        self._probe = batch

    @torch.no_grad()
    def step(self, closure=None):
        """Publish θ_v when the rule's rounds need it, refresh every `interval` steps (when a probe batch was given),
        then the rule's step on the current gradients. Returns the closure's loss (None without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        v, rule, backend = self.version, self.rule, self.backend
        stats: dict[str, float] = {}
        if rule.publishes(v, self.interval) and v not in backend.snapshots:
            stats.update(publish_version(self.book, backend, v))
        if v % self.interval == 0 and self._probe is not None:
            stats.update(refresh(rule, self.book, backend, self._probe, v))
        rule.step()
        self.version, self.last_stats = v + 1, stats
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.rule.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The rule's torch state_dict plus "zo_curv": its curvature state, the round book's and the version."""
        tensors, meta = self.rule.zo_state()
        book_tensors, book_meta = self.book.state()
        return {**self.rule.state_dict(), "zo_curv": {"tensors": {**tensors, **book_tensors},
                                                        "meta": {**meta, **book_meta}, "version": self.version}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()`. Rounds that were in flight are dropped and counted (their results would come
        from another process's fleet connection). Raises KeyError for a state_dict without "zo_curv"."""
        state_dict = dict(state_dict)
        zo = state_dict.pop("zo_curv")
        self.rule.load_state_dict(state_dict)
        self.state = self.rule.state
        self.rule.load_zo_state(zo["tensors"], zo["meta"])
        self.book.load_state(zo["tensors"], zo["meta"])
        self.book.drop_inflight()
        self.version = int(zo["version"])

    def close(self) -> None:
        """Close a fleet backend's connections (waiting for its uploads)."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close(wait=True)


def zocurv_wrapper(model: torch.nn.Module, *, method: str = "zocurv-block", backend: ProbeBackend | None = None,
                   loss_fn=None, timing: str = "async", **settings: Any) -> ZOCurvWrapper:
    """`ZOCurvWrapper` over the method registry's rule for `method`, its knobs from TrainConfig(optimizer=method,
    **settings) (validated there: one config, one place). Raises pydantic.ValidationError, ValueError."""
    cfg = TrainConfig(optimizer=method, **settings)
    rule = build_optimizer(cfg, model)
    return ZOCurvWrapper(model, rule, loss_fn=loss_fn or lm_batch_loss, backend=backend,
                         interval=cfg.curvature_interval, probe_batch_size=cfg.probe_batch_size,
                         staleness=cfg.staleness, timing=timing)
