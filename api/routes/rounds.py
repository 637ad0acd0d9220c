"""Probe rounds (open, progress, close) and the canary attestation of a run's workers."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.auth import Principal
from api.deps import Admin, IntakeD, MetricsD, Reader, RoundP, RunP, StoreD, WorkerOnly
from coordinator.errors import Invalid
from wire.messages import Attestation
from wire.round_messages import ProbeRound, RoundInfo

router = APIRouter(prefix="/v1/runs/{run}")


@router.post("/rounds", status_code=201, dependencies=[Admin])
def create_round(run: RunP, body: ProbeRound, store: StoreD, metrics: MetricsD) -> RoundInfo:
    if body.run != run:
        raise Invalid("round run differs from the URL's run")
    info, sent = store.rounds.create_round(body)
    if sent:
        metrics.rounds_opened.inc()
        metrics.tasks_published.inc(sent)
        if dropped := store.rounds.spot_dropped(run, body.round_id):
            metrics.spot_copies_dropped.labels("one_worker_at_open").inc(dropped)
    return info


@router.get("/rounds/{round_id}", dependencies=[Reader])
def get_round(run: RunP, round_id: RoundP, store: StoreD) -> RoundInfo:
    return store.rounds.round_info(run, round_id)


@router.post("/rounds/{round_id}/close", dependencies=[Admin])
def close_round(run: RunP, round_id: RoundP, store: StoreD) -> RoundInfo:
    return store.rounds.close_round(run, round_id)


@router.post("/attest")
def attest(
    run: RunP, body: Attestation, intake: IntakeD, metrics: MetricsD, who: Principal = WorkerOnly
) -> dict[str, bool]:
    """A worker proves its z generator: the digest of the run's canary direction."""
    if body.worker_id != who.worker_id:
        metrics.rejected_requests.labels("forbidden").inc()
        raise HTTPException(status_code=403, detail="a worker may attest only for itself")
    if not intake.attest(run, who.worker_id, body.digest):
        raise Invalid("canary digest does not match the run's; this worker generates a different z")
    return {"attested": True}
