"""The coordinator's REST API (FastAPI) over `coordinator.Store` and `coordinator.Intake`.

HTTP errors are raised here and nowhere else: store errors map to 404 (NotFound), 409 (Conflict) and
422 (Invalid, BlobError); every refused request is counted in `sparecycles_rejected_requests_total` by
reason. A background task marks workers whose lease expired as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Annotated

import redis
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool

from api.auth import Principal, require
from coordinator.blobs import BlobError
from coordinator.errors import Conflict, CoordinatorError, Invalid, NotFound
from coordinator.intake import Intake
from coordinator.messages import (
    Attestation,
    BlobInfo,
    Heartbeat,
    HeartbeatReply,
    IntakeReply,
    ProbeRound,
    ResultBatch,
    RoundInfo,
    RunInfo,
    RunSpec,
    SeedLedgerEntry,
    VersionManifest,
    WorkerInfo,
    WorkerRegistered,
    WorkerRegistration,
)
from coordinator.metrics import CoordinatorMetrics
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store, redis_client_kwargs

log = logging.getLogger("sparecycles.api")

RunP = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
RoundP = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")]
WorkerP = Annotated[str, Path(pattern=r"^w-[0-9a-f]{16}$")]
ShaP = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]
VersionP = Annotated[int, Path(ge=0, lt=2**53)]

Admin = Depends(require("admin"))
AdminOrSelf = Depends(require("admin", "worker", self_worker=True))
Reader = Depends(require("admin", "worker"))
WorkerOnly = Depends(require("worker"))
Enroll = Depends(require("enroll"))

_STATUS = {NotFound: 404, Conflict: 409, Invalid: 422}


class _CountingFileResponse(FileResponse):
    """FileResponse that counts the body bytes actually sent (full file or Range parts)."""

    def __init__(self, *args, counter, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._counter = counter

    async def __call__(self, scope, receive, send) -> None:
        async def counting_send(message) -> None:
            if message["type"] == "http.response.body":
                self._counter.inc(len(message.get("body", b"")))
            await send(message)

        await super().__call__(scope, receive, counting_send)


# Connections the asyncio Redis pool opens before serving: after a coordinator restart every worker posts
# at once, and opening a connection inside a request (TCP connect, HELLO, CLIENT SETINFO) adds its round
# trips and ~1 ms of event-loop CPU to that request and to every request queued behind it.
WARM_REDIS_CONNECTIONS = 32


def _fastapi_options() -> dict:
    """FastAPI constructor options. Recent FastAPI wraps each request in native OpenTelemetry checks
    (global provider look-ups, ~9% of the intake path's CPU) even when nothing is configured; the
    coordinator's telemetry is Prometheus (`/metrics`), so it is switched off where the option exists."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def _json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` documenting a JSON request body of `model` for a route that parses it itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def _with_body_schemas(schema: dict, *models: type[BaseModel]) -> dict:
    """Add the JSON schemas of `models` (and their nested models) to an OpenAPI document's components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in body.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = body
    return schema


async def _open_pool(client: AsyncRedis, n: int) -> None:
    """Open up to `n` pooled connections (n concurrent PINGs); a Redis outage only logs (see /readyz)."""
    try:
        await asyncio.wait_for(asyncio.gather(*(client.ping() for _ in range(n))), timeout=5.0)
    except (redis.RedisError, OSError, TimeoutError) as exc:
        log.warning("could not pre-open Redis connections: %s", exc)


def create_app(
    settings: CoordinatorSettings, *, store: Store | None = None, metrics: CoordinatorMetrics | None = None
) -> FastAPI:
    """Build the API. `store`/`metrics` may be injected (tests, in-process benches); otherwise created."""
    store = store or Store(settings)
    metrics = metrics or CoordinatorMetrics()
    metrics.attach_live(store.worker_state_counts, store.queue_depths)
    intake = Intake(store, metrics)

    async def reaper() -> None:
        while True:
            try:
                lost = await run_in_threadpool(store.reap_expired)
                metrics.lost.inc(len(lost))
            except redis.RedisError as exc:  # Redis briefly unreachable: /readyz reports it; keep reaping
                log.warning("lease reaper: %s", exc)
            await asyncio.sleep(settings.reaper_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await _open_pool(aredis(), WARM_REDIS_CONNECTIONS)
        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            client = clients.pop(asyncio.get_running_loop(), None)
            if client is not None:
                await client.aclose()

    app = FastAPI(title="sparecycles coordinator", version="1", lifespan=lifespan, **_fastapi_options())
    app.state.settings, app.state.store, app.state.metrics, app.state.intake = (
        settings,
        store,
        metrics,
        intake,
    )
    clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def aredis() -> AsyncRedis:
        # One asyncio Redis client per event loop (connections belong to the loop that opened them).
        loop = asyncio.get_running_loop()
        if loop not in clients:
            clients[loop] = AsyncRedis.from_url(
                settings.redis_url, decode_responses=True, **redis_client_kwargs()
            )
        return clients[loop]

    app.state.aredis = aredis

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _with_body_schemas(FastAPI.openapi(app), ResultBatch)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.token_cache = {}

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(request: Request, exc: CoordinatorError) -> JSONResponse:
        status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
        metrics.rejected_requests.labels(exc.reason).inc()
        return JSONResponse({"detail": str(exc)}, status_code=status)

    @app.exception_handler(BlobError)
    async def _blob_error(request: Request, exc: BlobError) -> JSONResponse:
        metrics.rejected_requests.labels("bad_blob").inc()
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected_requests.labels("validation").inc()
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(redis.RedisError)
    async def _redis_error(request: Request, exc: redis.RedisError) -> JSONResponse:
        metrics.rejected_requests.labels("redis_unavailable").inc()
        return JSONResponse(
            {"detail": "state store unavailable; retry"}, status_code=503, headers={"Retry-After": "1"}
        )

    # ---- the hot path first: routes are matched in registration order ------------------------------
    worker_only = require("worker")

    @app.post("/v1/runs/{run}/results", response_model=IntakeReply, openapi_extra=_json_body(ResultBatch))
    async def submit_results(run: RunP, request: Request) -> Response:
        """Intake of one task's results (a `ResultBatch`); the reply lists each result's outcome in order."""
        # The body is parsed and validated by pydantic-core straight from bytes, not through FastAPI's
        # body machinery (json.loads, then a Python-side validation): the same strict model, the same
        # 422, for less CPU on the path every result takes. Authentication still comes first.
        who = await worker_only(request)
        try:
            body = ResultBatch.model_validate_json(await request.body())
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None
        outcomes = await intake.submit_async(aredis(), who.worker_id, run, list(body.results))
        # Serialised directly (the hot path): the outcomes are already of the IntakeReply type.
        return Response(
            json.dumps({"schema_version": 1, "outcomes": outcomes}), media_type="application/json"
        )

    # ---- health and metrics -------------------------------------------------------------------------
    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        try:
            store.ping()
        except redis.RedisError as exc:
            return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # ---- workers ----------------------------------------------------------------------------------------
    @app.post("/v1/workers", status_code=201, dependencies=[Enroll])
    def register_worker(body: WorkerRegistration) -> WorkerRegistered:
        return store.register_worker(body)

    @app.get("/v1/workers", dependencies=[Admin])
    def list_workers() -> list[WorkerInfo]:
        return store.list_workers()

    @app.get("/v1/workers/{worker_id}", dependencies=[AdminOrSelf])
    def get_worker(worker_id: WorkerP) -> WorkerInfo:
        return store.worker_info(worker_id)

    @app.post(
        "/v1/workers/{worker_id}/heartbeat", dependencies=[Depends(require("worker", self_worker=True))]
    )
    def heartbeat(worker_id: WorkerP, body: Heartbeat) -> HeartbeatReply:
        return store.heartbeat(worker_id, body)

    @app.post("/v1/workers/{worker_id}/drain", dependencies=[AdminOrSelf])
    def drain(worker_id: WorkerP) -> WorkerInfo:
        store.set_worker_state(worker_id, "draining", ("active", "draining", "lost"))
        return store.worker_info(worker_id)

    @app.post("/v1/workers/{worker_id}/resume", dependencies=[AdminOrSelf])
    def resume(worker_id: WorkerP) -> WorkerInfo:
        store.set_worker_state(worker_id, "active", ("active", "draining"))
        return store.worker_info(worker_id)

    @app.delete("/v1/workers/{worker_id}", status_code=204, dependencies=[AdminOrSelf])
    def delete_worker(worker_id: WorkerP) -> Response:
        store.delete_worker(worker_id)
        for digest, (wid, _) in list(app.state.token_cache.items()):
            if wid == worker_id:
                app.state.token_cache.pop(digest, None)
        return Response(status_code=204)

    # ---- runs, versions, ledger -----------------------------------------------------------------------
    @app.post("/v1/runs", status_code=201, dependencies=[Admin])
    def create_run(body: RunSpec) -> RunInfo:
        return store.create_run(body)

    @app.get("/v1/runs/{run}", dependencies=[Reader])
    def get_run(run: RunP) -> RunInfo:
        return store.run_info(run)

    @app.post("/v1/runs/{run}/versions", status_code=201, dependencies=[Admin])
    def register_version(run: RunP, body: VersionManifest) -> VersionManifest:
        if body.run != run:
            raise Invalid("manifest run differs from the URL's run")
        return store.register_version(body)

    @app.get("/v1/runs/{run}/versions", dependencies=[Reader])
    def list_versions(run: RunP) -> list[int]:
        return store.list_versions(run)

    @app.get("/v1/runs/{run}/versions/{version}", dependencies=[Reader])
    def get_version(run: RunP, version: VersionP) -> VersionManifest:
        return store.get_version(run, version)

    @app.post("/v1/runs/{run}/ledger", status_code=201, dependencies=[Admin])
    def append_ledger(run: RunP, body: SeedLedgerEntry) -> SeedLedgerEntry:
        if body.run != run:
            raise Invalid("ledger entry run differs from the URL's run")
        return store.append_ledger(body)

    @app.get("/v1/runs/{run}/ledger", dependencies=[Reader])
    def get_ledger(
        run: RunP,
        since: Annotated[int, Query(ge=-1, lt=2**53)] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[SeedLedgerEntry]:
        return store.ledger(run, since, limit)

    # ---- blobs ------------------------------------------------------------------------------------------
    async def _upload(request: Request, expected: str | None) -> JSONResponse:
        writer = store.blobs.writer(expected)
        try:
            async for chunk in request.stream():
                writer.write(chunk)
            sha, size = writer.commit()
        finally:
            writer.abort()
        metrics.blob_bytes_stored.inc(size)
        return JSONResponse(BlobInfo(sha256=sha, bytes=size).model_dump(), status_code=201)

    @app.post("/v1/blobs", status_code=201, dependencies=[Admin], response_model=BlobInfo)
    async def upload_blob(
        request: Request, x_content_sha256: Annotated[str | None, Header(pattern=r"^[0-9a-f]{64}$")] = None
    ) -> JSONResponse:
        """Upload raw bytes (any content type); `X-Content-SHA256`, if given, must match."""
        return await _upload(request, x_content_sha256)

    @app.put("/v1/blobs/{sha256}", status_code=201, dependencies=[Admin], response_model=BlobInfo)
    async def put_blob(request: Request, sha256: ShaP) -> JSONResponse:
        """Upload raw bytes that must hash to `sha256`."""
        return await _upload(request, sha256)

    @app.get("/v1/blobs/{sha256}", dependencies=[Reader])
    def get_blob(sha256: ShaP, if_none_match: Annotated[str | None, Header()] = None) -> Response:
        """Stream a blob; ETag is the quoted sha256; Range requests give 206; unknown hashes 404."""
        if not store.blobs.exists(sha256):
            raise NotFound(f"no blob {sha256}")
        etag = f'"{sha256}"'
        headers = {"etag": etag, "cache-control": "public, max-age=31536000, immutable"}
        if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
            return Response(status_code=304, headers=headers)
        return _CountingFileResponse(
            store.blobs.path(sha256),
            media_type="application/octet-stream",
            headers=headers,
            counter=metrics.blob_bytes_served,
        )

    # ---- rounds and results ----------------------------------------------------------------------------
    @app.post("/v1/runs/{run}/rounds", status_code=201, dependencies=[Admin])
    def create_round(run: RunP, body: ProbeRound) -> RoundInfo:
        if body.run != run:
            raise Invalid("round run differs from the URL's run")
        info, sent = store.create_round(body)
        if sent:
            metrics.rounds_opened.inc()
            metrics.tasks_published.inc(sent)
        return info

    @app.get("/v1/runs/{run}/rounds/{round_id}", dependencies=[Reader])
    def get_round(run: RunP, round_id: RoundP) -> RoundInfo:
        return store.round_info(run, round_id)

    @app.post("/v1/runs/{run}/rounds/{round_id}/close", dependencies=[Admin])
    def close_round(run: RunP, round_id: RoundP) -> RoundInfo:
        return store.close_round(run, round_id)

    @app.post("/v1/runs/{run}/attest")
    def attest(run: RunP, body: Attestation, who: Principal = WorkerOnly) -> dict[str, bool]:
        """A worker proves its z generator: the digest of the run's canary direction."""
        if body.worker_id != who.worker_id:
            metrics.rejected_requests.labels("forbidden").inc()
            raise HTTPException(status_code=403, detail="a worker may attest only for itself")
        if not intake.attest(run, who.worker_id, body.digest):
            raise Invalid("canary digest does not match the run's; this worker generates a different z")
        return {"attested": True}

    @app.get("/", include_in_schema=False)
    def root() -> PlainTextResponse:
        return PlainTextResponse("sparecycles coordinator; see /docs\n")

    return app


def app_from_env() -> FastAPI:
    """uvicorn factory of a dedicated coordinator process (`sparecycles coordinator`, and each of its
    `--workers`): settings from the environment (raises pydantic.ValidationError on weak secrets).

    The objects built so far (FastAPI routes, pydantic schemas, Celery) live as long as the process; a
    full garbage collection would rescan all of them, a ~50 ms pause of the event loop (every request
    in flight waits). They are collected once and frozen out of the collector's generations.
    """
    app = create_app(CoordinatorSettings())
    _warm_endpoints(app)
    gc.collect()
    gc.freeze()
    return app


def _warm_endpoints(app: FastAPI) -> None:
    """Do FastAPI's lazy per-endpoint set-up now rather than inside each route's first request.

    FastAPI (>= 0.12x) locates every endpoint's source (inspect.getsourcelines, up to ~10 ms) on its first
    request and caches it; the first intake request after a start would stall every request behind it.
    A private helper, so only called where it exists.
    """
    import fastapi.routing

    extract = getattr(fastapi.routing, "_extract_endpoint_context", None)
    if extract is None:
        return
    for route in app.routes:
        if isinstance(route, fastapi.routing.APIRoute):
            extract(route.dependant.call)
