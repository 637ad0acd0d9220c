"""Teacher runs (issue 47): registered by the trainer (admin), their queues listed to every worker, the teacher's
manifest read by the workers that fetch its files as blobs (coordinator.teachers)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import Admin, Reader, RunP, ShaP, StoreD
from wire.teacher_messages import TeacherManifest, TeacherRun

router = APIRouter(prefix="/v1/teachers")


@router.post("", status_code=201, dependencies=[Admin])
def register_teacher_run(body: TeacherRun, store: StoreD) -> TeacherRun:
    """Register a run's teacher rounds: 422 when a file is not an uploaded blob of its size, 409 when the run is
    registered with another teacher; idempotent otherwise."""
    return store.teachers.register(body)


@router.post("/{run}/end", dependencies=[Admin])
def end_teacher_run(run: RunP, store: StoreD) -> dict[str, str | bool]:
    """Take the run's teacher queue off the list workers consume (they stop within one control interval)."""
    return {"run": run, "ended": store.teachers.end(run)}


@router.get("/{sha256}", dependencies=[Reader])
def get_teacher(sha256: ShaP, store: StoreD) -> TeacherManifest:
    """The manifest of a registered teacher (its files as blobs); 404 when none is registered."""
    return store.teachers.manifest(sha256)
