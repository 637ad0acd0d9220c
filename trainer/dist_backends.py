"""Probe backends for a torchrun job: every rank's mode collects the same round results, so every rank applies the
same update (ZO-Curv multipliers and curvature state, a pure-ZO step replayed from its seeds); no gradient traffic.

- `ShardedBackend` (in process): each rank evaluates its share of a round's seeds (seeds[r::N]) on rank 0's probe
  batch and all-gathers the scalars (L±, L0): K probes cost K/N forward pairs per rank.
- `LeaderBackend` (rank 0 with a fleet): wraps the fleet's backend (fleet.backend.CoordinatorBackend) and
  broadcasts what each `collect` handed out, or the error it raised (a stop's trainer.console.StopWaiting too: every
  rank's step is cut alike; every rank's trainer.zo.rounds.RoundBook has the fleet's timing, DistContext.fleet_rounds, so each makes the same collects).
- `FollowerBackend` (ranks > 0 with a fleet): talks to nobody; keeps the same version snapshots as the leader's and
  receives each `collect` from rank 0.

`adapt_mode` installs them in a built mode (trainer.modes.TrainMode), whatever object of it holds the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainer.console import StopWaiting
from trainer.distributed import DistContext
from trainer.methods import get_method
from trainer.mode_builders import build_mode
from trainer.zo.backend import Collected, InProcessBackend
from trainer.zo.probes import RoundSpec, SeedResult


class ShardedBackend(InProcessBackend):
    """InProcessBackend whose rounds are evaluated across the ranks: rank r takes seeds[r::N] on rank 0's batch
    (a ZO-Curv probe batch comes from rank 0's shard), then every rank holds all K results, in seed order.
    `forward_passes` counts every rank's forwards. Built by `adopt` from the mode's own InProcessBackend."""

    @classmethod
    def adopt(cls, backend: InProcessBackend, ctx: DistContext) -> ShardedBackend:
        """Take over a mode's fresh InProcessBackend, its state and its probe evaluator (whose hooks are already on
        the model) included."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(backend))
        new.ctx = ctx
        return new

    def _evaluate(self, r: RoundSpec) -> list[SeedResult]:
        ctx = self.ctx
        batch = ctx.broadcast_object(r.batch)
        mine = r.seeds[ctx.rank::ctx.world]
        before = self.forward_passes
        out = super()._evaluate(dataclasses.replace(r, batch=batch, seeds=mine)) if mine else []
        gathered = ctx.all_gather_object((out, self.forward_passes - before))
        self.forward_passes = before + sum(n for _, n in gathered)
        by_seed = {res.seed: res for part, _ in gathered for res in part}
        return [by_seed[s] for s in r.seeds]


class LeaderBackend:
    """Rank 0's view of a fleet backend: everything delegates to `inner`; `collect` also broadcasts its result
    (trainer.zo.backend.Collected and the forward-pass count), or the exception it raised, to the followers."""

    _OWN = ("inner", "ctx")

    def __init__(self, inner: Any, ctx: DistContext) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "ctx", ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # forward_passes / snapshots are the inner backend's
        setattr(self.inner, name, value)

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0, counts: bool = False) -> Collected:
        try:
            got = self.inner.collect(round_id, timeout_s, counts=counts)
        except (Exception, StopWaiting) as exc:  # a stop cuts every rank's step where rank 0 stopped waiting
            self.ctx.broadcast_object(("error", exc, 0))
            raise
        self.ctx.broadcast_object(("ok", got, self.inner.forward_passes))
        return got


class FollowerBackend(InProcessBackend):
    """A rank > 0's backend in a fleet run: publishing keeps snapshots as the leader's backend does (so the mode
    takes the same branches) but uploads nothing; `submit` evaluates nothing; `collect` receives rank 0's."""

    evaluates_published = True  # as the leader's fleet backend: a resume re-publishes and re-issues alike

    def __init__(self, model: torch.nn.Module, loss_fn: Any, ctx: DistContext, history: int) -> None:
        super().__init__(model, loss_fn, history=history)
        self.ctx = ctx

    def publish(self, version: int, weights: list[torch.Tensor] | None = None) -> None:
        if weights is not None:
            self.publish_weights(version, weights)
        else:
            super().publish(version)

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        self._advance(version)
        if self.history:
            self.snapshots[version] = blocks
            for v in sorted(self.snapshots)[: -self.history]:
                del self.snapshots[v]

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        self._advance(version)
        return True

    def submit(self, probe_round: RoundSpec) -> None:
        self._advance(probe_round.version)

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0, counts: bool = False) -> Collected:
        status, got, forwards = self.ctx.broadcast_object(None)
        if status == "error":
            raise got
        self.forward_passes = forwards
        return got

    def close(self, wait: bool = True) -> None:
        return None


def _backend_slot(mode: Any, depth: int = 3) -> Any:
    """The object in `mode` (the mode itself, a wrapper's `.mode`, or an object it owns) holding `backend`."""
    if "backend" in vars(mode):
        return mode
    if depth:
        for value in vars(mode).values():
            if hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in ("trainer", "fleet"):
                found = _backend_slot(value, depth - 1)
                if found is not None:
                    return found
    return None


def adapt_mode(mode: Any, ctx: DistContext) -> Any:
    """Install this rank's backend in a built mode: in process, a ShardedBackend in place of its InProcessBackend;
    with a fleet, rank 0's backend wrapped in a LeaderBackend (the followers' modes are built with a
    FollowerBackend: `build_rank_mode`). First-order modes (no backend) and one-process jobs are left as they are."""
    slot = _backend_slot(mode)
    if not ctx.parallel or slot is None:
        return mode
    backend = slot.backend
    if isinstance(backend, FollowerBackend | LeaderBackend):
        return mode
    if type(backend) is InProcessBackend:
        slot.backend = ShardedBackend.adopt(backend, ctx)
    elif ctx.is_main:
        slot.backend = LeaderBackend(backend, ctx)
    return mode


def build_rank_mode(cfg: Any, model: torch.nn.Module, loss_fn: Any, mode_factory: Any, ctx: DistContext) -> Any:
    """This rank's TrainMode: `mode_factory(cfg, model)` (rank 0's fleet mode; `loss_fn=` too with a --teacher) or trainer.mode_builders.build_mode, then
    `adapt_mode`. A rank > 0 of a fleet run builds its mode on a FollowerBackend (history as the fleet's: 0 for
    pure ZO, else 2) and never sees the fleet. One process: exactly the mode a plain run builds."""
    if ctx.parallel and ctx.fleet and not ctx.is_main:
        pure = get_method(cfg.optimizer).kind == "pure-zo"
        mode = build_mode(cfg, model, loss_fn, backend=FollowerBackend(model, loss_fn, ctx, history=0 if pure else 2),
                          timing=ctx.fleet_rounds)
    else:
        # A teacher's loss (trainer.kd) is the trainer's own: the fleet's workers evaluate the CE loss of its kind.
        own = {"loss_fn": loss_fn} if getattr(cfg, "teacher", None) is not None else {}
        mode = mode_factory(cfg, model, **own) if mode_factory else build_mode(cfg, model, loss_fn)
    return adapt_mode(mode, ctx)
