"""A fleet run that outlives its coordinator's store: when Redis comes back empty (a restart without persistence, a
failover to a fresh replica, an operator's flush) the coordinator no longer knows the trainer's run, its versions or
its rounds; `RecoveringBackend` creates the run again, re-publishes what the workers need and re-issues the rounds
in flight, then repeats the call that found out. ops/RUNBOOK.md "store-lost".

Every coordinator run the trainer owns goes through it: the probe run (fleet.attach), the fleet evaluation's
(fleet.evaluation.FleetEvaluator) and the anytime scorer's (fleet.anytime.FleetScorer). What differs is only which
versions are published again: the probe run's own (the publisher's fp32 snapshots, or the model's current weights),
or the owner's (`republish`: the evaluator's pending versions, the scorer's ring).

How the loss shows, by kind (`lost_run`): an HTTP 404 "unknown run" / "unknown round" (coordinator.client.Forgotten)
on any call, also raised later from a background upload, or the results stream's consumer group being gone
(coordinator.stream.StreamLost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.client import Forgotten
from coordinator.stream import StreamLost
from trainer import metrics as prom
from wire.messages import RunSpec
from wire.round_messages import ProbeRound

log = logging.getLogger("sparecycles.fleet")
T = TypeVar("T")
MAX_RECOVERIES_PER_CALL = 3  # a store lost again while recovering is tried again; past this, the error stands


def lost_run(exc: BaseException | None) -> bool:
    """True when `exc`, or an error it was raised from, says the coordinator lost the run: Forgotten for a run or a
    round (404), or StreamLost."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StreamLost) or (isinstance(exc, Forgotten) and exc.what in ("run", "round")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class _WireRound:
    """A round sent in wire form (`submit_wire`: an eval round) and its batch blob, kept to be re-issued."""

    wire: ProbeRound
    blob: bytes

    @property
    def versions(self) -> set[int]:
        """The versions the round reads: its own and its weight mixture's."""
        return {self.wire.version, *(t.version for t in (self.wire.eval.weights if self.wire.eval else ()))}


class RecoveringBackend:
    """Wraps a fleet.backend.CoordinatorBackend (composed of publisher, rounds, results, uploads) for run `spec`.

    Every ProbeBackend call (and `submit_wire`) goes through; one that finds the run lost (`lost_run`) triggers
    `recreate` and is made again. `recreate`: the upload queue's failed jobs are dropped, the run is created again
    (same id and spec), versions are published again, and every round still awaited is submitted again (only its
    seeds not yet handed out are awaited; a wire round is re-sent with those seeds alone; a round reading a version
    no longer published is dropped, logged). Which versions: `republish(publisher)` when given (the owner publishes
    what its rounds in flight read, in ascending order, through fleet.publisher.VersionPublisher), else the
    publisher's fp32 snapshots, or for pure ZO, which keeps none, the model's current weights as the latest version
    (which they are between calls). Counted in `recreated` and sparecycles_trainer_runs_recreated_total{run}.

    Args:
        backend: the CoordinatorBackend of run `spec`. spec: the RunSpec it was created with.
        republish: the owner's re-publication (above); None for the probe run.
    """

    evaluates_published = True  # a ProbeBackend attribute (trainer.zo.backend): as the wrapped fleet backend

    def __init__(self, backend: Any, spec: RunSpec, republish: Callable[[Any], None] | None = None) -> None:
        self.backend, self.spec, self.republish = backend, spec, republish
        self.recreated = 0
        self._rounds: dict[str, Any] = {}  # round id -> RoundSpec or _WireRound, while the collector awaits seeds

    # ---- what callers read (the wrapped backend's) ---------------------------------------------------------

    @property
    def run(self) -> str:
        """The coordinator run's id."""
        return self.spec.run

    @property
    def block_sizes(self) -> list[int]:
        return self.backend.block_sizes

    @property
    def latest_version(self) -> int | None:
        return self.backend.latest_version

    @property
    def snapshots(self) -> dict:
        return self.backend.snapshots

    @property
    def forward_passes(self) -> int:
        return self.backend.forward_passes

    @forward_passes.setter
    def forward_passes(self, value: int) -> None:  # a resumed run restores its count (trainer.zo.modes)
        self.backend.forward_passes = value

    def close(self, wait: bool = True, end: bool = False) -> None:
        """CoordinatorBackend.close (`end`: cancel the run's rounds on the coordinator)."""
        self.backend.close(wait=wait, end=end)

    def withdraw(self, round_id: str) -> None:
        """`forget` the round and close it on the coordinator (CoordinatorBackend.withdraw): no worker keeps
        evaluating it."""
        self.forget(round_id)
        self.backend.withdraw(round_id)

    def _call(self, fn: Callable[[], T], current: int | None = None) -> T:
        for attempt in range(MAX_RECOVERIES_PER_CALL + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == MAX_RECOVERIES_PER_CALL or not lost_run(exc):
                    raise
                self.recreate(exc, current)
        raise AssertionError("unreachable")

    # ---- ProbeBackend ---------------------------------------------------------------------------------------

    def publish(self, version: int, weights=None) -> None:
        """As the backend's; a version that a recovery made during this call published again itself (an owner's
        `republish` of the version being published) is not published twice."""
        start = self.recreated

        def once() -> None:
            if self.recreated != start and version in self.backend.publisher.published:
                return
            self.backend.publish(version, weights)

        self._call(once)

    def publish_weights(self, version: int, blocks) -> None:
        self._call(lambda: self.backend.publish_weights(version, blocks))

    def publish_ledger(self, version: int, seeds, coeffs, dist: str, scale: float = 1.0,
                       scale_min_dim: int = 0) -> bool:
        """As the backend's; when the run is found lost by this very call the model already holds `version`'s
        weights: they are re-published as a snapshot of `version`, which replaces the entry."""
        before = self.backend.latest_version

        def once() -> bool:
            if self.backend.latest_version is not None and self.backend.latest_version >= version:
                return True  # re-published by the recovery itself
            return self.backend.publish_ledger(version, seeds, coeffs, dist, scale, scale_min_dim)

        return self._call(once, current=version if before is not None and before < version else None)

    def submit(self, probe_round) -> None:
        self._call(lambda: self.backend.submit(probe_round))
        self._rounds[probe_round.round_id] = probe_round

    def submit_wire(self, wire: ProbeRound, blob: bytes) -> None:
        """CoordinatorBackend.submit_wire (an eval round), re-issued like any round after a loss."""
        self._call(lambda: self.backend.submit_wire(wire, blob))
        self._rounds[wire.round_id] = _WireRound(wire, blob)

    def forget(self, round_id: str) -> None:
        """The owner no longer wants `round_id`'s results (e.g. it evaluated them itself): neither awaited nor
        re-issued after a loss."""
        self._rounds.pop(round_id, None)
        self.backend.results.waiting.pop(round_id, None)

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0):
        out = self._call(lambda: self.backend.collect(round_id, timeout_s))
        waiting = self.backend.results.waiting
        for rid in [r for r in self._rounds if not waiting.get(r)]:
            del self._rounds[rid]
        return out

    def flush(self) -> None:
        self._call(self.backend.flush)

    # ---- recovery ---------------------------------------------------------------------------------------------

    def recreate(self, why: BaseException, current: int | None = None) -> None:
        """Create the run again on the coordinator and give it what the trainer still needs (class docstring).
        `current`: the version the model's weights are at when it is newer than the last one published (a ledger
        entry whose registration found the run lost). Raises what the coordinator's calls raise."""
        b, run = self.backend, self.spec.run
        log.warning("the coordinator lost run %s (%s); creating it again", run, str(why)[:200])
        b.uploads.recover()
        b.client.create_run(self.spec)
        b.results.reader.ensure_group()
        b.results.restart_counts()
        pub = b.publisher
        held = dict(pub.snapshots)
        latest = current if current is not None else pub.latest_version
        pub.published.clear()
        pub.snapshots.clear()
        if self.republish is not None:
            self.republish(pub)
        elif held:
            for v in sorted(held):
                pub.publish_weights(v, held[v])
        elif latest is not None:
            pub.publish(latest)  # pure ZO: the model's current weights are `latest`'s
        reissued, dropped = [], []
        for rid, spec in list(self._rounds.items()):
            left = set(b.results.waiting.get(rid, ()))
            if isinstance(spec, _WireRound):
                versions = spec.versions
            else:
                versions = {spec.version} | ({spec.base_version} if spec.base_version is not None else set())
            if not left:
                del self._rounds[rid]
            elif versions <= set(pub.published):
                if isinstance(spec, _WireRound):  # only the seeds still missing travel again
                    b.rounds.submit_wire(spec.wire.model_copy(update={"seeds": sorted(left)}), spec.blob)
                else:
                    b.rounds.submit(spec)
                b.results.waiting[rid] = left  # seeds handed out already are not awaited (nor used) again
                reissued.append(rid)
            else:
                b.results.waiting.pop(rid, None)
                del self._rounds[rid]
                dropped.append(rid)
        b.uploads.flush()
        self.recreated += 1
        prom.RUNS_RECREATED.labels(run).inc()
        log.warning("run %s created again: versions %s re-published, %d round(s) in flight re-issued%s", run,
                    pub.published, len(reissued),
                    f", {len(dropped)} dropped (their versions are no longer held)" if dropped else "")
