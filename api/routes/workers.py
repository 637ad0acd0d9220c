"""Workers: enrollment, listing, heartbeats, drain/resume, deletion."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from api.auth import Principal
from api.deps import Admin, AdminOrSelf, Enroll, SelfWorker, StoreD, WorkerP
from wire.messages import Heartbeat, HeartbeatReply, WorkerInfo, WorkerRegistered, WorkerRegistration

router = APIRouter(prefix="/v1/workers")


@router.post("", status_code=201)
def register_worker(body: WorkerRegistration, store: StoreD, who: Principal = Enroll) -> WorkerRegistered:
    """Join the fleet; 429 past the enrollment token's cap or registration rate."""
    return store.workers.register_worker(body, enrolled_by=who.token_id or "default")


@router.get("", dependencies=[Admin])
def list_workers(
    store: StoreD,
    response: Response,
    after: Annotated[str, Query(pattern=r"^(w-[0-9a-f]{16})?$")] = "",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[WorkerInfo]:
    """Workers sorted by id, `limit` per page from the id after `after`; header `X-Next-After` holds the
    cursor of the next page when there is one."""
    page, cursor = store.workers.list_workers(after, limit)
    if cursor is not None:
        response.headers["X-Next-After"] = cursor
    return page


@router.get("/{worker_id}", dependencies=[AdminOrSelf])
def get_worker(worker_id: WorkerP, store: StoreD) -> WorkerInfo:
    return store.workers.worker_info(worker_id)


@router.post("/{worker_id}/heartbeat", dependencies=[SelfWorker])
def heartbeat(worker_id: WorkerP, body: Heartbeat, store: StoreD) -> HeartbeatReply:
    return store.workers.heartbeat(worker_id, body)


@router.post("/{worker_id}/drain")
def drain(worker_id: WorkerP, store: StoreD, who: Principal = AdminOrSelf) -> WorkerInfo:
    """Stop giving the worker tasks; an admin's drain is sticky (the worker cannot resume it)."""
    store.workers.set_worker_state(worker_id, "draining", ("active", "draining", "lost"), actor=who.role)
    return store.workers.worker_info(worker_id)


@router.post("/{worker_id}/resume")
def resume(worker_id: WorkerP, store: StoreD, who: Principal = AdminOrSelf) -> WorkerInfo:
    """Back to active; 409 for a quarantined worker, or for a worker resuming an admin's drain."""
    store.workers.set_worker_state(worker_id, "active", ("active", "draining"), actor=who.role)
    return store.workers.worker_info(worker_id)


@router.delete("/{worker_id}", status_code=204, dependencies=[AdminOrSelf])
def delete_worker(worker_id: WorkerP, store: StoreD, request: Request) -> Response:
    store.workers.delete_worker(worker_id)
    cache = request.app.state.token_cache
    for digest, (wid, _) in list(cache.items()):
        if wid == worker_id:
            cache.pop(digest, None)
    return Response(status_code=204)
