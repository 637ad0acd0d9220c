"""The anytime model's candidates scored on the fleet (`train --anytime --coordinator`, `--eval-on fleet|auto`).

`FleetScorer` is a trainer.anytime.select.Score, the interface of the in-process scorer
(trainer.anytime.serve.InProcessScorer): given candidates [(name, coefficients over the ring's versions)] it
returns each one's per-batch selection losses. It publishes the ring's versions on a coordinator run of its own
(`<prefix>-any-<hex>`) and opens one `eval` round per candidate whose weights are the mixture
(wire.round_messages.EvalSpec, Σ coeff·θ_version) over the selection split's windows; the workers build
θ(c) with trainer.anytime.ring.build_mixture and score batch k with trainer.evaluation.batch_values, the code
the in-process scorer runs, so the losses — and the candidate chosen — are the same bit for bit. A round that
gets no result for `deadline_s` seconds is finished here (the missing batches scored on a scratch model). A
coordinator that loses the run (its store came back empty) gets it again, with the ring and the candidates in
flight (fleet.recovery).
Selection, fitting and serving stay in trainer.anytime (one selection code path, two scorers).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.anytime.ring import VersionRing
from trainer.evaluation import EvalWindows, batch_values
from trainer.zo.probes import canonical_blocks
from wire import batch as batch_wire
from wire.bounds import MAX_STALENESS  # an eval run's results never go stale: every version's score is wanted
from wire.messages import RunSpec, share_fields
from wire.round_messages import MAX_EVAL_TERMS, EvalSpec, ProbeRound, WeightTerm

log = logging.getLogger("sparecycles.fleet")


class FleetScorer:
    """trainer.anytime.select.Score on a coordinator's probe workers.

    Args:
        ring: the trainer's VersionRing (k <= wire.round_messages.MAX_EVAL_TERMS: every version is a term).
        model: the trained module (its architecture; a scratch copy is made for publishing and fallbacks).
        windows: the selection split's windows (trainer.evaluation.lm_windows of its (N,) token ids, as
            trainer.anytime.serve.Anytime takes them).
        fleet: a fleet.attach.Fleet. model_preset: the run's model preset (the workers build the architecture).
        deadline_s: seconds without a result for a round after which its missing batches are scored here.
        device: where fallbacks run.
    Raises ValueError when the ring holds more versions than an eval round may name; CoordinatorHTTPError when
    the coordinator refuses the run.
    """

    def __init__(self, ring: VersionRing, model: torch.nn.Module, windows: EvalWindows, *, fleet: Any,
                 model_preset: str | None, deadline_s: float = 120.0, device: str = "cpu", poll_s: float = 0.05) -> None:
        from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress

        if ring.k > MAX_EVAL_TERMS:
            raise ValueError(f"the fleet scores mixtures of at most {MAX_EVAL_TERMS} versions; --anytime-k is {ring.k}")
        self.ring, self.deadline_s, self.device, self.poll_s = ring, deadline_s, device, poll_s
        self.windows = windows
        self.blob = batch_wire.encode_batch(self.windows.tensors, "lm")
        self.blob_sha = hashlib.sha256(self.blob).hexdigest()
        self.scratch = copy.deepcopy(model).eval()
        per_task = min(64, max(1, -(-self.windows.n_batches // (4 * max(1, fleet.workers)))))
        spec = RunSpec(run=f"{fleet.run_prefix}-any-{secrets.token_hex(4)}", model_class=type(model).__name__,
                       model_preset=model_preset, staleness=MAX_STALENESS, seeds_per_task=per_task,
                       **share_fields(fleet.share),
                       **({"spot_check_fraction": 0.0} if fleet.workers < 2 else {}))
        backend = CoordinatorBackend.connect(self.scratch, spec, FleetAddress.of(fleet.base, fleet.settings),
                                             BackendTuning.publishing(fleet.settings.blob_dir))
        # Outlives a coordinator whose store comes back empty: the run is created again, the ring published again
        # and the candidates in flight re-issued (fleet.recovery).
        self.backend = backend.recoverable(spec, republish=self._republish)
        self.run = spec.run
        self.published: set[int] = set()
        self.rounds = 0
        self.fallback_batches = 0  # batches scored here after a deadline (0 when the fleet answered everything)

    @torch.no_grad()
    def _publish_ring(self, publish: Callable[..., None] | None = None) -> None:
        """Publish the ring's versions the coordinator has not seen (fp32 canonical blocks of each) with `publish`
        (default: the backend's)."""
        for v in self.ring.versions:
            if v not in self.published:
                self.scratch.load_state_dict(self.ring.state(v))
                (publish or self.backend.publish)(v, weights=[b.param.detach().to("cpu", copy=True)
                                                              for b in canonical_blocks(self.scratch)])
                self.published.add(v)

    def _republish(self, publisher: Any) -> None:
        """fleet.recovery's `republish`: the coordinator lost this run; publish the ring again (the candidates in
        flight mix its versions: they are re-issued after)."""
        self.published.clear()
        self._publish_ring(publisher.publish)

    def __call__(self, cands: Sequence[tuple[str, tuple[float, ...]]]) -> list[torch.Tensor]:
        """Per-batch selection losses of each candidate, (n_batches,) float64 each, in `cands` order."""
        self._publish_ring()
        n, versions = self.windows.n_batches, self.ring.versions
        ids = []
        for name, coefs in cands:
            spec = self.ring.spec(name, coefs)  # validated: one coefficient per version, summing to 1
            self.rounds += 1
            rid = f"any-{self.rounds}"
            terms = [WeightTerm(version=v, coeff=c) for v, c in zip(spec.versions, spec.coefs, strict=True)]
            wire = ProbeRound(schema_version=3, run=self.run, round_id=rid, version=versions[-1],
                              batch_sha256=self.blob_sha, eps=1.0, distribution="rademacher", seeds=list(range(n)),
                              kind="eval", eval=EvalSpec(split=self.windows.split, batch_size=self.windows.batch_size,
                                                         weights=terms))
            self.backend.submit_wire(wire, self.blob)
            ids.append(rid)
        values = self._collect(ids)
        for rid, (name, coefs) in zip(ids, cands, strict=True):
            missing = [k for k in range(n) if k not in values[rid]]
            if missing:
                log.warning("anytime candidate %s: %d of %d selection batches scored on the trainer", name,
                            len(missing), n)
                values[rid].update(self._score_here(self.ring.spec(name, coefs), missing))
                self.fallback_batches += len(missing)
            self.backend.forget(rid)  # done: never re-issued after a later loss of the store
        return [torch.tensor([values[rid][k] for k in range(n)], dtype=torch.float64) for rid in ids]

    def _collect(self, ids: list[str]) -> dict[str, dict[int, float]]:
        """The rounds' batch losses as they arrive, until all are in or none arrives for `deadline_s` (a recovery of
        the run, fleet.recovery, restarts the wait: its rounds were re-issued)."""
        values: dict[str, dict[int, float]] = {rid: {} for rid in ids}
        want = len(ids) * self.windows.n_batches
        last = time.monotonic()
        while sum(map(len, values.values())) < want and time.monotonic() - last < self.deadline_s:
            recreated = self.backend.recreated
            for r in self.backend.collect().results:
                if r.round_id in values:
                    values[r.round_id].setdefault(int(r.seed), r.l_plus)
                    last = time.monotonic()
            if self.backend.recreated != recreated:
                last = time.monotonic()
            time.sleep(self.poll_s)
        return values

    @torch.no_grad()
    def _score_here(self, spec, batches: list[int]) -> dict[int, float]:
        self.scratch.load_state_dict(self.ring.build(spec))
        return {k: batch_values(self.scratch, "lm", self.windows.batch(k, self.device))[0] for k in batches}

    def close(self, wait: bool = True) -> None:
        """Close the backend (its uploads: finished when `wait`, else cancelled)."""
        self.backend.close(wait=wait, end=True)
