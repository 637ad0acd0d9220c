"""The round lifecycle of a ZO-Curv run, in one object the training mode owns: `RoundBook`.

A ZO-Curv refresh issues probe rounds (trainer.zo.probes.RoundSpec) to a ProbeBackend; their results come back
through `collect` (at once in process, late on a fleet), each (round, seed) at most once, already judged by the
backend's authority (stale: older than the latest version − S; duplicate). The book keeps every round issued and
not yet folded, with the results it took, and hands a refresh's rounds to the update rule once all of them are
complete; rounds whose version fell behind the staleness bound before completing are dropped and counted.

When a round folds is the book's `timing` (FOLD_TIMINGS), whatever the fleet's timing:
- "async": at the first refresh after all its results arrived (in process: its own refresh);
- "sync" (`train --fleet-wait sync`): `collect` waits (up to `timeout_s` per round) for every round issued, so each
  folds at its own refresh and a fleet run equals the in-process one bit for bit;
- "next" (`up`): `collect` waits for every round but the newest refresh's, and `before_publish` waits for all of them
  before a newer version is published (so none can arrive stale): a round folds at the refresh after it.

Interface (what the mode calls, in order, at a refresh of version v): `before_publish(backend, v)` before each
publish; `issue(backend, rounds)`; `collect(backend)`; `due(v)` -> the rounds to fold. For checkpoints:
`state()` / `load_state()` (the rounds in flight with their batches and the results they took), `inflight()`,
`drop_inflight()`, `take_early()` (a resume's re-issued round). `stats(prefix)` gives the counters to log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from trainer.zo.backend import COUNT_KEYS, Collected, ProbeBackend
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from wire.bounds import Staleness, check
from wire.staleness import is_stale

FOLD_TIMINGS = ("async", "sync", "next")
_TAKEN = ("accepted", "stale", "duplicate")  # the authority's counts a run logs (COUNT_KEYS' first three)


class RoundBook:
    """Rounds issued and not yet folded or dropped (module docstring).

    Args:
        staleness: bound S in versions (wire.bounds.Staleness): a round of version u still incomplete at a
            refresh of version v is dropped when wire.staleness.is_stale(u, v, S).
        timing: one of FOLD_TIMINGS.
        timeout_s: the longest `collect` / `before_publish` wait for one round under "sync" and "next" (seconds).
    Attributes: counts ({accepted, stale, duplicate}: the authority's outcomes, summed), dropped (rounds dropped),
    folded (rounds folded into the update rule), refreshes (refreshes that had rounds issued or pending) and
    refreshes_folded (those of them at which at least one round folded: a refresh "with data"; trainer.health).
    Raises ValueError for an unknown timing or a bound outside Staleness.
    """

    def __init__(self, staleness: int, timing: str = "async", timeout_s: float = 300.0) -> None:
        if timing not in FOLD_TIMINGS:
            raise ValueError(f"timing must be one of {FOLD_TIMINGS}, got {timing!r}")
        self.staleness, self.timing, self.timeout_s = check(Staleness, staleness), timing, timeout_s
        self.counts = dict.fromkeys(_TAKEN, 0)
        self.dropped = 0
        self.folded = self.refreshes = self.refreshes_folded = 0
        self._pending: dict[str, RoundSpec] = {}  # issued, not folded nor dropped (issue order = version order)
        self._arrived: dict[str, dict[int, SeedResult]] = {}
        self._waiting: list[str] = []  # "sync"/"next": issued, not yet waited for

    # ---- the lifecycle ---------------------------------------------------------------------------------
    def issue(self, backend: ProbeBackend, rounds: Sequence[RoundSpec]) -> None:
        """Submit each round not already pending (one re-issued from a checkpoint is pending already). A round is
        pending only once sent: a submit that raised is sent again by the retried step. Under "next" a round at a
        version newer than the backend's latest first waits for the rounds in flight."""
        for r in rounds:
            if r.round_id in self._pending:
                continue
            latest = backend.latest_version
            if self.timing == "next" and (latest is None or r.version > latest):
                self._wait(backend, list(self._waiting))
            backend.submit(r)
            self._pending[r.round_id], self._arrived[r.round_id] = r, {}
            if self.timing != "async":
                self._waiting.append(r.round_id)

    def before_publish(self, backend: ProbeBackend, version: int) -> None:
        """Call before publishing `version`: under "next" wait for every round in flight first."""
        if self.timing == "next":
            self._wait(backend, list(self._waiting))

    def collect(self, backend: ProbeBackend) -> None:
        """Take what the backend has for the rounds due under `timing` (module docstring). Under "next" that is every
        round of a version older than the newest issued: a refresh's rounds (several for zocurv-group, -trust) are
        all left to the next refresh, so the trainer never waits for the refresh it is in."""
        if self.timing == "async":
            self.take(backend.collect(counts=True))
            return
        if self.timing == "next":
            newest = max((self._pending[rid].version for rid in self._waiting), default=None)
            self._wait(backend, [rid for rid in self._waiting if self._pending[rid].version != newest])
            return
        self._wait(backend, list(self._waiting))
        if self.timing == "sync":
            self.take(backend.collect(counts=True))

    def _wait(self, backend: ProbeBackend, round_ids: list[str]) -> None:
        for rid in round_ids:
            self.take(backend.collect(rid, self.timeout_s, counts=True))
            self._waiting.remove(rid)

    def take(self, got: Collected) -> None:
        """Record collected results and add the authority's counts. A result of a round no longer pending (closed,
        or issued before a resume) is counted stale."""
        for k in _TAKEN:
            self.counts[k] += got.counts.get(k, 0)
        for x in got.results:
            if x.round_id in self._pending:
                self._arrived[x.round_id][x.seed] = x
            else:
                self.counts["stale"] += 1
                self.counts["accepted"] -= 1

    def due(self, version: int) -> list[list[tuple[RoundSpec, list[SeedResult]]]]:
        """The refreshes to fold now, oldest first: for each version all of whose rounds are complete, its rounds
        (issue order) each with its results in seed order. A version with an incomplete round that is stale at
        `version` is dropped (its rounds counted in `dropped`); others stay pending."""
        by_version: dict[int, list[RoundSpec]] = {}
        for r in self._pending.values():
            by_version.setdefault(r.version, []).append(r)
        out = []
        for v, rounds in sorted(by_version.items()):
            if all(len(self._arrived[r.round_id]) == len(r.seeds) for r in rounds):
                out.append([(r, [self._arrived[r.round_id][s] for s in r.seeds]) for r in rounds])
            elif is_stale(v, version, self.staleness):
                self.dropped += len(rounds)
            else:
                continue
            for r in rounds:
                self._forget(r.round_id)
        self.refreshes += 1
        self.refreshes_folded += bool(out)
        self.folded += sum(len(rounds) for rounds in out)
        return out

    def _forget(self, rid: str) -> None:
        del self._pending[rid], self._arrived[rid]
        if rid in self._waiting:
            self._waiting.remove(rid)

    def stats(self, prefix: str) -> dict[str, float]:
        """`<prefix>_accepted|stale|duplicate|dropped_rounds|pending_rounds|folded_rounds|refreshes|
        refreshes_with_data` as floats (the last three cumulative: trainer.health reads them)."""
        out = {f"{prefix}_{k}": float(v) for k, v in self.counts.items()}
        out[f"{prefix}_dropped_rounds"] = float(self.dropped)
        out[f"{prefix}_folded_rounds"] = float(self.folded)
        out[f"{prefix}_refreshes"] = float(self.refreshes)
        out[f"{prefix}_refreshes_with_data"] = float(self.refreshes_folded)
        out[f"{prefix}_pending_rounds"] = float(len(self._pending))
        return out

    # ---- checkpoints ----------------------------------------------------------------------------------
    def inflight(self) -> list[RoundSpec]:
        """The rounds issued and not yet folded nor dropped, oldest first."""
        return list(self._pending.values())

    def drop_inflight(self) -> None:
        """Forget the rounds in flight, counting each as dropped (a resume that cannot re-issue them)."""
        self.dropped += len(self._pending)
        self._pending.clear()
        self._arrived.clear()
        self._waiting.clear()

    def take_early(self, backend: ProbeBackend, r: RoundSpec) -> None:
        """Re-issue a pending round restored from a checkpoint and wait (up to `timeout_s`) for its results without
        folding: it folds at the next refresh, as in the uninterrupted run."""
        backend.submit(r)
        self.take(backend.collect(r.round_id, counts=True))  # timeout 0: the backend's own round timeout

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON): counts, dropped rounds and the rounds in flight, each one's spec (its batch, when a tuple
        of tensors, as tensors `round/<i>/batch/<j>`, once: a round sharing an earlier round's batch object, as a
        refresh's rounds do, names it as `batch_of` <that round's i>) and the results it already took."""
        tensors: dict[str, torch.Tensor] = {}
        rounds = []
        first: dict[int, int] = {}  # id(batch) -> index of the round whose tensors hold it
        storages: set[int] = set()
        for i, (rid, r) in enumerate(self._pending.items()):
            batch = isinstance(r.batch, tuple) and all(isinstance(t, torch.Tensor) for t in r.batch)
            batch_of = first.get(id(r.batch)) if batch else None
            if batch and batch_of is None:
                first[id(r.batch)] = i
                for j, t in enumerate(r.batch):
                    t = t.contiguous()
                    if t.untyped_storage().data_ptr() in storages:  # views of one window (x, y): safetensors
                        t = t.clone()  # refuses tensors sharing memory, so this one gets its own
                    storages.add(t.untyped_storage().data_ptr())
                    tensors[f"round/{i}/batch/{j}"] = t
            rounds.append({"round_id": rid, "version": r.version, "eps": r.eps, "seeds": list(r.seeds),
                           "distribution": r.distribution, "want_clean": r.want_clean,
                           "kind": ProbeKind(r.kind).value, "base_version": r.base_version, "blocks": list(r.blocks),
                           "slices": [list(s) for s in r.slices],
                           "batch_len": len(r.batch) if batch else None, "batch_of": batch_of,
                           "arrived": [dataclasses.asdict(x) for x in self._arrived[rid].values()]})
        return tensors, {"counts": dict(self.counts), "dropped_rounds": self.dropped, "folded_rounds": self.folded,
                         "refreshes": self.refreshes, "refreshes_folded": self.refreshes_folded, "inflight": rounds}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `state()`; its rounds in flight are pending again, those whose batch was not saved are dropped.
        A checkpoint of an older format (no rounds kept) restores none."""
        self.counts = {k: int(meta.get("counts", {}).get(k, 0)) for k in _TAKEN}
        self.dropped = int(meta.get("dropped_rounds", 0))
        self.folded = int(meta.get("folded_rounds", 0))
        self.refreshes = int(meta.get("refreshes", 0))
        self.refreshes_folded = int(meta.get("refreshes_folded", 0))
        self._pending.clear()
        self._arrived.clear()
        self._waiting.clear()
        batches: dict[int, tuple[torch.Tensor, ...]] = {}  # rounds that shared a batch share it again
        for i, d in enumerate(meta.get("inflight", [])):
            if d["batch_len"] is None:
                self.dropped += 1
                continue
            at = i if d.get("batch_of") is None else int(d["batch_of"])  # older checkpoints: every round its own
            if at not in batches:
                batches[at] = tuple(tensors[f"round/{at}/batch/{j}"] for j in range(d["batch_len"]))
            batch = batches[at]
            # checkpoints written before the round fields took the wire's names say "dist" and "group"
            r = RoundSpec(d["round_id"], int(d["version"]), batch, float(d["eps"]), tuple(d["seeds"]),
                          d.get("distribution", d.get("dist")), want_clean=bool(d["want_clean"]),
                          kind=ProbeKind(d["kind"]), base_version=d["base_version"],
                          blocks=tuple(d.get("blocks", d.get("group", ()))),
                          slices=tuple(tuple(s) for s in d.get("slices", [])))
            self._pending[r.round_id] = r
            self._arrived[r.round_id] = {int(x["seed"]): SeedResult(**x) for x in d["arrived"]}


assert set(_TAKEN) <= set(COUNT_KEYS)
