"""A fleet run that outlives its coordinator's store: when Redis comes back empty (a restart without persistence, a
failover to a fresh replica, an operator's flush) the coordinator no longer knows the trainer's run, its versions or
its rounds; the trainer's backend creates the run again, re-publishes what the workers need and re-issues the rounds
in flight, then repeats the call that found out. ops/RUNBOOK.md "store-lost".

Recovery is part of the backend, not a wrapper around it: a fleet.backend.CoordinatorBackend made `recoverable(spec,
republish)` runs each call through `recovering` and, when the call finds the run lost, `recreate` here, which uses
only its parts' own methods (publisher, round sender, result collector, upload queue, client). Every coordinator run
the trainer owns is made so: the probe run (fleet.attach), the fleet evaluation's (fleet.evaluation.FleetEvaluator)
and the anytime scorer's (fleet.anytime.FleetScorer). What differs is only which versions are published again: the
probe run's own (the publisher's fp32 snapshots, or the model's current weights), or the owner's (`republish`: the
evaluator's pending versions, the scorer's ring).

How the loss shows, by kind (`lost_run`): an HTTP 404 "unknown run" / "unknown round" (coordinator.client.Forgotten)
on any call, also raised later from a background upload, or the results stream's consumer group being gone
(coordinator.stream.StreamLost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

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
class WireRound:
    """A round sent in wire form (`submit_wire`: an eval round) and its batch blob, kept to be re-issued."""

    wire: ProbeRound
    blob: bytes

    @property
    def versions(self) -> set[int]:
        """The versions the round reads: its own and its weight mixture's."""
        return {self.wire.version, *(t.version for t in (self.wire.eval.weights if self.wire.eval else ()))}


class Recoverable(Protocol):
    """What `recovering` and `recreate` need of a backend (fleet.backend.CoordinatorBackend): its run's spec, the
    owner's `republish`, its count of re-creations, the rounds it awaits (round id -> RoundSpec or WireRound) and its
    parts."""

    spec: RunSpec | None
    republish: Callable[[Any], None] | None
    recreated: int
    inflight: dict[str, Any]
    client: Any
    uploads: Any
    publisher: Any
    rounds: Any
    results: Any


def recovering(backend: Recoverable, fn: Callable[[], T], current: int | None = None) -> T:
    """`fn()`; when it finds the run lost (`lost_run`) and `backend.spec` is set, `recreate` the run and call it
    again, up to MAX_RECOVERIES_PER_CALL times. `current`: as `recreate`'s. Raises what `fn` raises otherwise."""
    for attempt in range(MAX_RECOVERIES_PER_CALL + 1):
        try:
            return fn()
        except Exception as exc:
            if backend.spec is None or attempt == MAX_RECOVERIES_PER_CALL or not lost_run(exc):
                raise
            recreate(backend, exc, current)
    raise AssertionError("unreachable")


def _republish(backend: Recoverable, current: int | None) -> list[int]:
    """Publish again what the workers need (`recreate`); returns the versions published."""
    pub = backend.publisher
    held, latest = pub.forget_published()
    latest = current if current is not None else latest
    if backend.republish is not None:
        backend.republish(pub)
    elif held:
        for v in sorted(held):
            pub.publish_weights(v, held[v])
    elif latest is not None:
        pub.publish(latest)  # pure ZO: the model's current weights are `latest`'s
    return list(pub.published)


def recreate(backend: Recoverable, why: BaseException, current: int | None = None) -> None:
    """Create the run again on the coordinator and give it what the trainer still needs: the upload queue's failed
    jobs are dropped, the run is created again (same id and spec), versions are published again (`republish(
    publisher)` when set, else the publisher's fp32 snapshots, or for pure ZO, which keeps none, the model's current
    weights as the latest version, which they are between calls; `current`: the version the weights are at when
    newer than the last one published, a ledger entry whose registration found the run lost), and every round still
    awaited is submitted again (only its seeds not yet handed out are awaited; a wire round is re-sent with those
    seeds alone; a round reading a version no longer published is dropped, logged). Counted in `recreated` and
    sparecycles_trainer_runs_recreated_total{run}. Raises what the coordinator's calls raise."""
    run, results = backend.spec.run, backend.results
    log.warning("the coordinator lost run %s (%s); creating it again", run, str(why)[:200])
    backend.uploads.recover()
    backend.client.create_run(backend.spec)
    results.restart()
    published = set(_republish(backend, current))
    reissued, dropped = [], []
    for rid, spec in list(backend.inflight.items()):
        left = results.missing(rid)
        if isinstance(spec, WireRound):
            versions = spec.versions
        else:
            versions = {spec.version} | ({spec.base_version} if spec.base_version is not None else set())
        if not left:
            del backend.inflight[rid]
        elif versions <= published:
            if isinstance(spec, WireRound):  # only the seeds still missing travel again
                backend.rounds.submit_wire(spec.wire.model_copy(update={"seeds": sorted(left)}), spec.blob)
            else:
                backend.rounds.submit(spec)
            results.await_only(rid, left)  # seeds handed out already are not awaited (nor used) again
            reissued.append(rid)
        else:
            results.forget(rid)
            del backend.inflight[rid]
            dropped.append(rid)
    backend.uploads.flush()
    backend.recreated += 1
    prom.RUNS_RECREATED.labels(run).inc()
    log.warning("run %s created again: versions %s re-published, %d round(s) in flight re-issued%s", run,
                sorted(published), len(reissued),
                f", {len(dropped)} dropped (their versions are no longer held)" if dropped else "")
