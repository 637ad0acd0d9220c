"""Runs, snapshot versions and the pure-ZO seed ledger."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, TypeVar

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from api.deps import Admin, MetricsD, Reader, RunP, StoreD, VersionP
from coordinator.errors import Invalid
from wire.messages import IntakeCounts, RunInfo, RunSpec, SeedLedgerEntry, VersionManifest

router = APIRouter(prefix="/v1/runs")


@router.post("", status_code=201, dependencies=[Admin])
def create_run(body: RunSpec, store: StoreD) -> RunInfo:
    return store.runs.create_run(body)


RunBody = TypeVar("RunBody", VersionManifest, SeedLedgerEntry)
MAX_WAIT_S = 10.0  # a long poll's limit: bounds how long a graceful shutdown waits for pending ones
POLL_S = 0.05  # how often a waiting request re-reads the run's latest version (one HGET)


@router.get("/{run}", dependencies=[Reader])
async def get_run(run: RunP, store: StoreD,
                  newer_than: Annotated[int | None, Query(ge=-1, description="Long poll: wait for a version above this")] = None,
                  wait_s: Annotated[float, Query(ge=0.0, le=MAX_WAIT_S, description="Long poll: seconds to wait at most")] = 0.0,
                  ) -> RunInfo:
    """The run's spec, queue, latest version and open rounds. With `newer_than` and `wait_s` a long poll: the
    reply comes as soon as the latest version exceeds `newer_than` (checked every POLL_S seconds), or after
    `wait_s` seconds with the run as it is, so a worker learns of a new version within ~50 ms of its
    registration without polling on a short period. 404 for an unknown run."""
    info = await run_in_threadpool(store.runs.run_info, run)
    if newer_than is None or wait_s <= 0 or info.latest_version > newer_than:
        return info
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if await run_in_threadpool(store.runs.latest_version, run) > newer_than:
            break
    return await run_in_threadpool(store.runs.run_info, run)


@router.post("/{run}/end", dependencies=[Admin])
def end_run(run: RunP, store: StoreD, metrics: MetricsD) -> dict[str, int | str]:
    """The trainer's run ended: its open rounds are closed, its queue leaves the list workers consume (they stop
    within one control interval), the tasks still queued are deleted, and the workers' broker users may no longer
    take from it (`revoked_broker_users`: withdrawn now, counted in `sparecycles_broker_grants_revoked_total`).
    Idempotent; 404 for an unknown run."""
    closed = store.runs.end_run(run)
    purged = store.dispatch.purge_queue(run)
    revoked = store.workers.revoke_queue(store.keys.queue_for(run))
    metrics.broker_revoked.inc(revoked)
    return {"run": run, "closed_rounds": closed, "purged_tasks": purged, "revoked_broker_users": revoked}


@router.get("/{run}/intake", dependencies=[Reader])
def get_intake_counts(run: RunP, store: StoreD) -> IntakeCounts:
    return store.runs.intake_counts(run)


def _of_run(body: RunBody, run: str) -> RunBody:
    """`body` if it names the URL's run; Invalid (422) otherwise."""
    if body.run != run:
        raise Invalid(f"{type(body).__name__} run {body.run!r} differs from the URL's run {run!r}")
    return body


@router.post("/{run}/versions", status_code=201, dependencies=[Admin])
def register_version(run: RunP, body: VersionManifest, store: StoreD) -> VersionManifest:
    return store.runs.register_version(_of_run(body, run))


@router.get("/{run}/versions", dependencies=[Reader])
def list_versions(run: RunP, store: StoreD) -> list[int]:
    return store.runs.list_versions(run)


@router.get("/{run}/versions/{version}", dependencies=[Reader])
def get_version(run: RunP, version: VersionP, store: StoreD) -> VersionManifest:
    return store.runs.get_version(run, version)


@router.post("/{run}/ledger", status_code=201, dependencies=[Admin])
def append_ledger(run: RunP, body: SeedLedgerEntry, store: StoreD) -> SeedLedgerEntry:
    return store.runs.append_ledger(_of_run(body, run))


@router.get("/{run}/ledger", dependencies=[Reader])
def get_ledger(
    run: RunP,
    store: StoreD,
    since: Annotated[int, Query(ge=-1, lt=2**53)] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[SeedLedgerEntry]:
    return store.runs.ledger(run, since, limit)
