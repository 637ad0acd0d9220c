"""Workers: enrollment, listing, heartbeats, drain/resume, deletion."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.deps import Admin, AdminOrSelf, Enroll, SelfWorker, StoreD, WorkerP
from coordinator.messages import Heartbeat, HeartbeatReply, WorkerInfo, WorkerRegistered, WorkerRegistration

router = APIRouter(prefix="/v1/workers")


@router.post("", status_code=201, dependencies=[Enroll])
def register_worker(body: WorkerRegistration, store: StoreD) -> WorkerRegistered:
    return store.register_worker(body)


@router.get("", dependencies=[Admin])
def list_workers(store: StoreD) -> list[WorkerInfo]:
    return store.list_workers()


@router.get("/{worker_id}", dependencies=[AdminOrSelf])
def get_worker(worker_id: WorkerP, store: StoreD) -> WorkerInfo:
    return store.worker_info(worker_id)


@router.post("/{worker_id}/heartbeat", dependencies=[SelfWorker])
def heartbeat(worker_id: WorkerP, body: Heartbeat, store: StoreD) -> HeartbeatReply:
    return store.heartbeat(worker_id, body)


@router.post("/{worker_id}/drain", dependencies=[AdminOrSelf])
def drain(worker_id: WorkerP, store: StoreD) -> WorkerInfo:
    store.set_worker_state(worker_id, "draining", ("active", "draining", "lost"))
    return store.worker_info(worker_id)


@router.post("/{worker_id}/resume", dependencies=[AdminOrSelf])
def resume(worker_id: WorkerP, store: StoreD) -> WorkerInfo:
    store.set_worker_state(worker_id, "active", ("active", "draining"))
    return store.worker_info(worker_id)


@router.delete("/{worker_id}", status_code=204, dependencies=[AdminOrSelf])
def delete_worker(worker_id: WorkerP, store: StoreD, request: Request) -> Response:
    store.delete_worker(worker_id)
    cache = request.app.state.token_cache
    for digest, (wid, _) in list(cache.items()):
        if wid == worker_id:
            cache.pop(digest, None)
    return Response(status_code=204)
