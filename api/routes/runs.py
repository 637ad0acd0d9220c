"""Runs, snapshot versions and the pure-ZO seed ledger."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import Admin, Reader, RunP, StoreD, VersionP
from coordinator.errors import Invalid
from coordinator.messages import IntakeCounts, RunInfo, RunSpec, SeedLedgerEntry, VersionManifest

router = APIRouter(prefix="/v1/runs")


@router.post("", status_code=201, dependencies=[Admin])
def create_run(body: RunSpec, store: StoreD) -> RunInfo:
    return store.create_run(body)


@router.get("/{run}", dependencies=[Reader])
def get_run(run: RunP, store: StoreD) -> RunInfo:
    return store.run_info(run)


@router.get("/{run}/intake", dependencies=[Reader])
def get_intake_counts(run: RunP, store: StoreD) -> IntakeCounts:
    return store.intake_counts(run)


@router.post("/{run}/versions", status_code=201, dependencies=[Admin])
def register_version(run: RunP, body: VersionManifest, store: StoreD) -> VersionManifest:
    if body.run != run:
        raise Invalid("manifest run differs from the URL's run")
    return store.register_version(body)


@router.get("/{run}/versions", dependencies=[Reader])
def list_versions(run: RunP, store: StoreD) -> list[int]:
    return store.list_versions(run)


@router.get("/{run}/versions/{version}", dependencies=[Reader])
def get_version(run: RunP, version: VersionP, store: StoreD) -> VersionManifest:
    return store.get_version(run, version)


@router.post("/{run}/ledger", status_code=201, dependencies=[Admin])
def append_ledger(run: RunP, body: SeedLedgerEntry, store: StoreD) -> SeedLedgerEntry:
    if body.run != run:
        raise Invalid("ledger entry run differs from the URL's run")
    return store.append_ledger(body)


@router.get("/{run}/ledger", dependencies=[Reader])
def get_ledger(
    run: RunP,
    store: StoreD,
    since: Annotated[int, Query(ge=-1, lt=2**53)] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[SeedLedgerEntry]:
    return store.ledger(run, since, limit)
