"""The `ProbeBackend` protocol (where probe rounds are evaluated) and the in-process backend.

A probe round (DESIGN.md §3, "Probe round") is (round id, version, batch, ε, distribution, seeds,
want-clean) plus a probe *kind*:
- ``seeded``: direction z(seed) of `dist` over all canonical parameters (kernels' seeded direction);
- ``block_scaled``: z = Σ_b a_b r_b with a = estimators.block_scales(seed), r Rademacher from
  estimators.block_sign_seed(seed) at each element's global offset (per-block curvature, DESIGN.md §2);
- ``along_update``: seed = block index b; direction û_b = u_b·√n_b/‖u_b‖ with u_b = θ_v − θ_{base}
  restricted to block b (unit RMS, so ε means the same as for a unit-variance z); the result carries
  scale = ‖u_b‖/√n_b so the caller can convert back to step units (ZO-Curv (c)).
Results arrive as they are evaluated (possibly late, duplicated or out of order on a fleet), each
stamped with the version it was computed against. The in-process backend evaluates synchronously and
can delay delivery by a number of rounds to exercise the staleness path.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from kernels import ProbeEvaluator, perturb
from trainer.zo import estimators as est


class ProbeKind(str, Enum):
    """How a round's seeds map to perturbation directions (see module docstring)."""

    SEEDED = "seeded"
    BLOCK_SCALED = "block_scaled"
    ALONG_UPDATE = "along_update"


@dataclass(frozen=True)
class ProbeRound:
    """One round of probes sharing a batch and a clean loss (common random numbers).

    Attributes:
        round_id: unique name of the round.
        version: weight version θ_v the probes are taken at.
        batch: task batch passed to the backend's loss function as is (in process: tensors).
        eps: probe step ε > 0 (parameter units, for a unit-RMS direction).
        seeds: probe seeds (for ``along_update``: block indices).
        dist: "rademacher" or "gauss8" (``seeded`` only).
        want_clean: also evaluate L0 = L(θ_v).
        kind: a ProbeKind.
        base_version: θ_base for ``along_update`` (usually version − 1).
    Raises ValueError at construction for an empty seed list, eps <= 0, or a missing base_version.
    """

    round_id: str
    version: int
    batch: Any
    eps: float
    seeds: tuple[int, ...]
    dist: str = "rademacher"
    want_clean: bool = False
    kind: ProbeKind = ProbeKind.SEEDED
    base_version: int | None = None

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("a probe round needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds of a round must be distinct (results are deduplicated by (round, seed))")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")
        if self.kind is ProbeKind.ALONG_UPDATE and self.base_version is None:
            raise ValueError("along_update rounds need base_version (the version the step started from)")


@dataclass(frozen=True)
class ProbeResult:
    """Scalars of one probe: losses in nats (task loss units), stamped with the version probed.

    `l0` is None unless the round wanted the clean loss; `scale` is ‖u_b‖/√n_b for along_update probes
    (0.0 when the block did not move, in which case l_plus = l_minus = l0 and the probe carries nothing).
    """

    round_id: str
    seed: int
    version: int
    l_plus: float
    l_minus: float
    l0: float | None = None
    scale: float | None = None
    worker: str = "in-process"


class ProbeBackend(Protocol):
    """Where probe rounds run. Implementations: InProcessBackend (here); a coordinator backend (fleet)."""

    def publish(self, version: int) -> None:
        """Make the model's current weights available as `version` (monotone)."""
        ...

    def submit(self, probe_round: ProbeRound) -> None:
        """Queue a round for evaluation; returns at once or after evaluating (in process)."""
        ...

    def poll(self, round_id: str | None = None) -> list[ProbeResult]:
        """Results delivered since the last poll (only those of `round_id` if given; others stay queued)."""
        ...


@dataclass
class _Param:
    name: str
    tensor: torch.nn.Parameter
    offset: int
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = self.tensor.numel()


class InProcessBackend:
    """Evaluate probe rounds in this process on `model`, leaving its clean weights bit-identical.

    Seeded probes go through kernels.ProbeEvaluator; block-scaled and along-update probes build their
    perturbed weights out of place (kernels.perturb: fp32 math, one rounding to the param dtype) and
    swap them in for the forward pass only. The original storages are never written.

    Args:
        model: the trained module; blocks are `list(model.named_parameters())` in that order.
        loss_fn: (model, batch) -> scalar loss tensor (nats).
        history: number of published versions kept as fp32 snapshots (>= 2 for along_update rounds).
        delay_rounds: hold each round's results until this many later rounds were submitted
            (simulates a fleet's late results; 0 = deliver at once).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 history: int = 0, delay_rounds: int = 0) -> None:
        if history < 0 or delay_rounds < 0:
            raise ValueError("history and delay_rounds must be >= 0")
        self.model, self.loss_fn = model, loss_fn
        self.history, self.delay_rounds = history, delay_rounds
        offsets = itertools.accumulate((p.numel() for _, p in model.named_parameters()), initial=0)
        self.params = [_Param(n, p, o) for (n, p), o in zip(model.named_parameters(), offsets)]
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self._held: deque[list[ProbeResult]] = deque()
        self._ready: list[ProbeResult] = []
        self.forward_passes = 0
        self.evaluator = ProbeEvaluator(model, loss_fn)  # seeded probes: hooks, one module's scratch at a time

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order."""
        return [p.numel for p in self.params]

    def publish(self, version: int) -> None:
        """Snapshot the current weights (fp32) as `version` when history > 0; keep the newest `history`."""
        if self.history == 0:
            return
        if self.snapshots and version <= max(self.snapshots):
            raise ValueError(f"version {version} is not newer than {max(self.snapshots)}")
        self.snapshots[version] = [p.tensor.detach().float().clone() for p in self.params]
        for v in sorted(self.snapshots)[: -self.history]:
            del self.snapshots[v]

    @contextlib.contextmanager
    def _swapped(self, new: dict[int, torch.Tensor]) -> Iterator[None]:
        """Point block i's .data at new[i] for the duration; restore the original storage objects."""
        saved = {i: self.params[i].tensor.data for i in new}
        try:
            for i, t in new.items():
                self.params[i].tensor.data = t
            yield
        finally:
            for i, t in saved.items():
                self.params[i].tensor.data = t

    @torch.no_grad()
    def _loss(self, batch: Any, new: dict[int, torch.Tensor] | None = None) -> float:
        self.forward_passes += 1
        with self._swapped(new or {}):
            return float(self.loss_fn(self.model, batch))

    def _seeded(self, batch: Any, seed: int, alpha: float, dist: str) -> float:
        self.forward_passes += 1
        return self.evaluator.loss(batch, seed, alpha, dist)

    def _block_scaled(self, seed: int, alpha: float) -> dict[int, torch.Tensor]:
        a = est.block_scales(seed, len(self.params))
        rs = est.block_sign_seed(seed)
        return {i: perturb(p.tensor.detach(), rs, p.offset, alpha * float(a[i]), "rademacher")
                for i, p in enumerate(self.params)}

    def _evaluate(self, r: ProbeRound) -> list[ProbeResult]:
        l0 = self._loss(r.batch) if r.want_clean else None
        out = []
        for s in r.seeds:
            scale = None
            if r.kind is ProbeKind.SEEDED:
                lp = self._seeded(r.batch, s, r.eps, r.dist)
                lm = self._seeded(r.batch, s, -r.eps, r.dist)
            elif r.kind is ProbeKind.BLOCK_SCALED:
                lp = self._loss(r.batch, self._block_scaled(s, r.eps))
                lm = self._loss(r.batch, self._block_scaled(s, -r.eps))
            else:
                lp, lm, scale = self._along(r, s, l0)
            out.append(ProbeResult(r.round_id, s, r.version, lp, lm, l0, scale))
        return out

    def _along(self, r: ProbeRound, b: int, l0: float | None) -> tuple[float, float, float]:
        if r.base_version not in self.snapshots or r.version not in self.snapshots:
            raise ValueError(f"along_update needs published versions {r.base_version} and {r.version}; "
                             f"have {sorted(self.snapshots)} (construct the backend with history >= 2)")
        if not 0 <= b < len(self.params):
            raise ValueError(f"block index {b} out of range [0, {len(self.params)})")
        p = self.params[b]
        u = self.snapshots[r.version][b] - self.snapshots[r.base_version][b]
        norm = float(torch.linalg.vector_norm(u.double()))
        scale = norm / math.sqrt(p.numel)
        if norm == 0.0:
            base = l0 if l0 is not None else self._loss(r.batch)
            return base, base, 0.0
        w = p.tensor.detach()
        uhat = u / scale
        lp = self._loss(r.batch, {b: (w.float() + r.eps * uhat).to(w.dtype)})
        lm = self._loss(r.batch, {b: (w.float() - r.eps * uhat).to(w.dtype)})
        return lp, lm, scale

    def submit(self, probe_round: ProbeRound) -> None:
        """Evaluate the round now; its results become visible after `delay_rounds` further submits."""
        self._held.append(self._evaluate(probe_round))
        while len(self._held) > self.delay_rounds:
            self._ready.extend(self._held.popleft())

    def flush(self) -> None:
        """Deliver every held result now (end of run)."""
        while self._held:
            self._ready.extend(self._held.popleft())

    def poll(self, round_id: str | None = None) -> list[ProbeResult]:
        """Return (and remove) delivered results, only those of `round_id` if given."""
        if round_id is None:
            got, self._ready = self._ready, []
        else:
            got = [x for x in self._ready if x.round_id == round_id]
            self._ready = [x for x in self._ready if x.round_id != round_id]
        return got


def collect_round_counted(backend: ProbeBackend, probe_round: ProbeRound, timeout_s: float = 0.0,
                          poll_s: float = 0.05) -> tuple[list[ProbeResult], dict[str, int]]:
    """Submit a round and wait for one result per seed; also return intake counts.

    Results stamped with another version than the round's are counted `stale` and ignored (a pure-ZO
    step needs every slope at the same θ); redeliveries of a seed are counted `duplicate`. Polls every
    `poll_s` seconds until all seeds arrived or `timeout_s` passed (0: poll once — synchronous backends).
    Returns (results in seed order, {"accepted", "stale", "duplicate"}).
    Raises RuntimeError naming the missing seeds when the deadline passes.
    """
    backend.submit(probe_round)
    by_seed: dict[int, ProbeResult] = {}
    counts = {"accepted": 0, "stale": 0, "duplicate": 0}
    deadline = time.monotonic() + timeout_s
    while True:
        for res in backend.poll(probe_round.round_id):
            if res.version != probe_round.version:
                counts["stale"] += 1
            elif res.seed in by_seed:
                counts["duplicate"] += 1
            else:
                by_seed[res.seed] = res
                counts["accepted"] += 1
        missing = [s for s in probe_round.seeds if s not in by_seed]
        if not missing:
            return [by_seed[s] for s in probe_round.seeds], counts
        if time.monotonic() >= deadline:
            raise RuntimeError(f"round {probe_round.round_id}: no result for {len(missing)} of "
                               f"{len(probe_round.seeds)} seeds after {timeout_s} s; raise the timeout, or use "
                               "a backend that delivers synchronously (InProcessBackend with delay_rounds=0)")
        time.sleep(poll_s)


def collect_round(backend: ProbeBackend, probe_round: ProbeRound, timeout_s: float = 0.0) -> list[ProbeResult]:
    """`collect_round_counted` without the counts: one result per seed, in seed order."""
    return collect_round_counted(backend, probe_round, timeout_s)[0]


def losses(results: Sequence[ProbeResult]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(l_plus (K,), l_minus (K,), l0 (K,) or None) as float64 tensors from a list of results."""
    lp = torch.tensor([r.l_plus for r in results], dtype=torch.float64)
    lm = torch.tensor([r.l_minus for r in results], dtype=torch.float64)
    l0 = None if any(r.l0 is None for r in results) else torch.tensor([r.l0 for r in results], dtype=torch.float64)
    return lp, lm, l0
