"""The `ProbeBackend` protocol (where probe rounds are evaluated), the in-process backend and the collector.

A probe round (DESIGN.md §3, "Probe round"; trainer.zo.probes.RoundSpec) is evaluated by a backend: in
this process (`InProcessBackend`) or by the coordinator's fleet (fleet.backend.CoordinatorBackend). The
meaning of each probe kind lives in trainer.zo.probes, shared with the fleet's workers.

Results arrive as they are evaluated (possibly late on a fleet), each stamped with the version it was
computed against. Which results count is decided by one authority, the coordinator's intake (stale:
older than the latest version − S; duplicate: a (round, seed) seen before), or, in process, by
`InProcessBackend` applying the same rules when it delivers. A backend hands out each (round, seed) at
most once, through `collect`, together with the authority's counts; `collect_round` is the one collector
the trainer's steps use.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from probe_kernels import ProbeEvaluator
from trainer.zo import probes
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from wire.bounds import Staleness, check
from wire.staleness import is_stale, oldest_fresh

COUNT_KEYS = ("accepted", "stale", "duplicate", "dropped", "retracted")


@dataclass(frozen=True)
class Collected:
    """What a `collect` call hands out: results, each (round, seed) once, and the authority's counts.

    counts: outcomes since the previous collect, keys COUNT_KEYS: `accepted` (handed out now), `stale`
    (evaluated at a version older than the latest − S, never handed out), `duplicate` (a redelivered
    (round, seed)), `dropped` (spot-check replicas disagreed: the seed will not come), `retracted` (a
    handed-out value withdrawn; a fresh evaluation follows).
    """

    results: list[SeedResult]
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))


class ProbeBackend(Protocol):
    """Where probe rounds run. Implementations: InProcessBackend (here); fleet.backend.CoordinatorBackend.

    Attributes every backend has: `forward_passes` (forward passes behind the results handed out),
    `snapshots` ({version: fp32 copies of the canonical blocks} of the newest published versions, as
    many as the backend's `history`), `evaluates_published` (True when rounds are evaluated on the published
    versions, elsewhere: a resume then publishes saved weights again (`publish_weights`) and re-issues the rounds
    in flight; False when they are evaluated on the live model, in process).
    """

    forward_passes: int
    snapshots: dict[int, list[torch.Tensor]]
    evaluates_published: bool

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order (trainer.zo.probes.canonical_blocks)."""
        ...

    @property
    def latest_version(self) -> int | None:
        """The newest version published (snapshot or ledger entry), None before the first."""
        ...

    def publish(self, version: int) -> None:
        """Make the model's current weights available as `version` (monotone)."""
        ...

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        """Record `version` as a seed-ledger entry on `latest_version` (theta_version = scale * theta_parent
        + sum_k coeffs[k] z(seeds[k]), `scale` on tensors with >= scale_min_dim dims); True if recorded,
        False when the backend keeps no ledger (the next round then publishes a snapshot)."""
        ...

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        """Publish `blocks` (fp32 canonical blocks, as `snapshots` holds them) as `version` (backends with
        `evaluates_published` only)."""
        ...

    def submit(self, probe_round: RoundSpec) -> None:
        """Queue a round for evaluation; returns at once or after evaluating (in process)."""
        ...

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0, counts: bool = False) -> Collected:
        """Results not handed out before (only `round_id`'s if given; others stay queued) and the counts.

        With a `round_id`, waits up to `timeout_s` seconds until all its seeds arrived (or were dropped). The
        authority's `stale` / `duplicate` counts only with `counts` (a fleet asks its coordinator for them: an HTTP
        call); without, they stay 0 and go to the next collect that asks.
        """
        ...


class InProcessBackend:
    """Evaluate probe rounds in this process on `model`, leaving its clean weights bit-identical.

    Every kind goes through trainer.zo.probes.probe_losses: seeded probes through probe_kernels.ProbeEvaluator,
    the others with perturbed blocks built out of place and swapped in for the forward pass only.

    It plays the coordinator's intake too: a delivered result whose version is older than the latest
    version − `staleness` is counted `stale` and never handed out.

    Args:
        model: the trained module; blocks are trainer.zo.probes.canonical_blocks(model).
        loss_fn: (model, batch) -> scalar loss tensor (nats).
        history: number of published versions kept as fp32 snapshots (>= 2 for along_update rounds).
        delay_rounds: hold each round's results until this many later rounds were submitted
            (simulates a fleet's late results; 0 = deliver at once).
        staleness: bound S in versions (None: no bound), as a run's RunSpec.staleness on the coordinator.
    Raises ValueError for negative arguments.
    """

    evaluates_published = False  # rounds run on the live model: a resume cannot re-issue older rounds

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 history: int = 0, delay_rounds: int = 0, staleness: int | None = None) -> None:
        if history < 0 or delay_rounds < 0:
            raise ValueError("history and delay_rounds must be >= 0")
        if staleness is not None:
            check(Staleness, staleness)
        self.model, self.loss_fn = model, loss_fn
        self.history, self.delay_rounds, self.staleness = history, delay_rounds, staleness
        self.blocks = probes.canonical_blocks(model)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self._latest: int | None = None
        self._held: deque[list[SeedResult]] = deque()
        self._ready: list[SeedResult] = []
        self._counts: Counter[str] = Counter()
        self._accepted: dict[tuple[str, int], int] = {}  # (round, seed) -> version, as intake's dedupe hash
        self.forward_passes = 0
        self.evaluator = ProbeEvaluator(model, loss_fn)  # seeded probes: hooks, one module's scratch at a time

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order."""
        return probes.block_sizes(self.blocks)

    @property
    def latest_version(self) -> int | None:
        """The newest version published or probed (a round probes the current weights)."""
        return self._latest

    def _advance(self, version: int) -> None:
        self._latest = version if self._latest is None else max(self._latest, version)

    def publish(self, version: int) -> None:
        """Snapshot the current weights (fp32) as `version` when history > 0; keep the newest `history`.

        Raises ValueError if `version` is not newer than the newest snapshot.
        """
        self._advance(version)
        if self.history == 0:
            return
        if self.snapshots and version <= max(self.snapshots):
            raise ValueError(f"version {version} is not newer than {max(self.snapshots)}")
        self.snapshots[version] = [b.param.detach().float().clone() for b in self.blocks]
        for v in sorted(self.snapshots)[: -self.history]:
            del self.snapshots[v]

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        """Not available in process (rounds run on the live model). Raises NotImplementedError."""
        raise NotImplementedError("InProcessBackend evaluates the live model; it cannot publish given weights")

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        """In process the weights are the model's own: nothing to record; returns False."""
        return False

    def _loss(self, batch: Any, new: dict[int, torch.Tensor] | None = None) -> float:
        self.forward_passes += 1
        return probes.swapped_loss(self.model, self.blocks, self.loss_fn, batch, new)

    def _seeded(self, batch: Any, seed: int, alpha: float, dist: str) -> float:
        self.forward_passes += 1
        return self.evaluator.loss(batch, seed, alpha, dist)

    def _site(self, r: RoundSpec) -> probes.ProbeSite:
        update = None
        if probes.KINDS[ProbeKind(r.kind)].needs_base:  # along_update, line, group_line: θ_v − θ_base
            if r.base_version not in self.snapshots or r.version not in self.snapshots:
                raise ValueError(f"{ProbeKind(r.kind).value} needs published versions {r.base_version} and "
                                 f"{r.version}; have {sorted(self.snapshots)} (construct the backend with history >= 2)")
            new, base = self.snapshots[r.version], self.snapshots[r.base_version]

            def update(b: int) -> torch.Tensor:
                return new[b] - base[b]
        return probes.ProbeSite(self.blocks, lambda new: self._loss(r.batch, new),
                                lambda s, a, d: self._seeded(r.batch, s, a, d), update)

    def _evaluate(self, r: RoundSpec) -> list[SeedResult]:
        if r.blocks:
            probes.check_fits(self.blocks, r.blocks, r.slices)
        site = self._site(r)
        l0 = self._loss(r.batch) if r.want_clean else None
        out = []
        for s in r.seeds:
            lp, lm, scale = probes.probe_losses(site, r.kind, s, r.eps, r.distribution, r.blocks, l0, r.slices)
            out.append(SeedResult(round_id=r.round_id, seed=s, version=r.version, l_plus=lp, l_minus=lm, l0=l0,
                                  scale=scale))
        return out

    def _deliver(self, results: list[SeedResult]) -> None:
        """Intake, as the coordinator's: results older than latest − S are counted stale, a (round, seed)
        delivered before is counted duplicate; neither is handed out."""
        for res in results:
            key = (res.round_id, res.seed)
            if self._latest is not None and is_stale(res.version, self._latest, self.staleness):
                self._counts["stale"] += 1
            elif key in self._accepted:
                self._counts["duplicate"] += 1
            else:
                self._accepted[key] = res.version
                self._ready.append(res)
        if self.staleness is not None and self._latest is not None:  # older keys can only be stale now
            floor = oldest_fresh(self._latest, self.staleness)
            self._accepted = {k: v for k, v in self._accepted.items() if v >= floor}

    def submit(self, probe_round: RoundSpec) -> None:
        """Evaluate the round now; its results become visible after `delay_rounds` further submits.

        Raises ValueError for a round along θ_v − θ_base without both snapshots, ProbeFitError (a ValueError) for
        a group or slice outside the blocks.
        """
        self._advance(probe_round.version)
        self._held.append(self._evaluate(probe_round))
        while len(self._held) > self.delay_rounds:
            self._deliver(self._held.popleft())

    def flush(self) -> None:
        """Deliver every held result now (end of run)."""
        while self._held:
            self._deliver(self._held.popleft())

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0, counts: bool = False) -> Collected:
        """Hand out delivered results (only `round_id`'s if given) with the counts since the last collect.

        Never waits: delivery happens on `submit`/`flush`, so `timeout_s` is accepted and ignored; the counts are
        this process's own, so they come whatever `counts` says.
        """
        if round_id is None:
            got, self._ready = self._ready, []
        else:
            got = [x for x in self._ready if x.round_id == round_id]
            self._ready = [x for x in self._ready if x.round_id != round_id]
        counts = {k: self._counts[k] for k in COUNT_KEYS}
        counts["accepted"] += len(got)
        self._counts.clear()
        return Collected(got, counts)


def collect_round(backend: ProbeBackend, probe_round: RoundSpec,
                  timeout_s: float = 0.0) -> tuple[list[SeedResult], dict[str, int]]:
    """Submit a round and collect one result per seed: (results in seed order, the backend's counts).

    The backend's authority (coordinator intake, or InProcessBackend) has already removed stale and
    duplicate results. Raises RuntimeError naming the missing seeds when `timeout_s` passes first (or at
    once for a synchronous backend that holds results back).
    """
    backend.submit(probe_round)
    got = backend.collect(probe_round.round_id, timeout_s, counts=True)
    by_seed = {r.seed: r for r in got.results}
    missing = [s for s in probe_round.seeds if s not in by_seed]
    if missing:
        raise RuntimeError(f"round {probe_round.round_id}: no result for {len(missing)} of "
                           f"{len(probe_round.seeds)} seeds after {timeout_s} s; raise the timeout, or use "
                           "a backend that delivers synchronously (InProcessBackend with delay_rounds=0)")
    return [by_seed[s] for s in probe_round.seeds], got.counts


def losses(results: Sequence[SeedResult]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(l_plus (K,), l_minus (K,), l0 (K,) or None) as float64 tensors from a list of results."""
    lp = torch.tensor([r.l_plus for r in results], dtype=torch.float64)
    lm = torch.tensor([r.l_minus for r in results], dtype=torch.float64)
    l0 = None if any(r.l0 is None for r in results) else torch.tensor([r.l0 for r in results], dtype=torch.float64)
    return lp, lm, l0
