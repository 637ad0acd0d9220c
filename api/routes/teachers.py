"""Teacher runs: registered by the trainer (admin), their queues listed to every worker, the teacher's
manifest read by the workers that fetch its files as blobs (coordinator.teachers)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Admin, MetricsD, Reader, RunP, ShaP, StoreD
from wire.teacher_messages import TeacherManifest, TeacherRun, teacher_queue

router = APIRouter(prefix="/v1/teachers")


@router.post("", status_code=201, dependencies=[Admin])
def register_teacher_run(body: TeacherRun, store: StoreD) -> TeacherRun:
    """Register a run's teacher rounds: 422 when a file is not an uploaded blob of its size, 409 when the run is
    registered with another teacher; idempotent otherwise."""
    return store.teachers.register(body)


@router.post("/{run}/end", dependencies=[Admin])
def end_teacher_run(run: RunP, store: StoreD, metrics: MetricsD) -> dict[str, str | bool | int]:
    """Take the run's teacher queue off the list workers consume (they stop within one control interval); the
    workers' broker users may no longer take from it (`revoked_broker_users`, as a probe run's end). Idempotent."""
    ended = store.teachers.end(run)
    revoked = store.workers.revoke_queue(teacher_queue(run)) if ended else 0
    metrics.broker_revoked.inc(revoked)
    return {"run": run, "ended": ended, "revoked_broker_users": revoked}


@router.get("/{sha256}", dependencies=[Reader])
def get_teacher(sha256: ShaP, store: StoreD) -> TeacherManifest:
    """The manifest of a registered teacher (its files as blobs); 404 when none is registered."""
    return store.teachers.manifest(sha256)
