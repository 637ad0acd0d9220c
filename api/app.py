"""The coordinator's REST API (FastAPI) over `coordinator.Store` and `coordinator.Intake`.

Routes live in one router per resource (`api.routes`: results, health, workers, runs, blobs, rounds);
this module builds the app, its Redis clients, error handlers and the lease reaper. HTTP errors are
raised in `api` and nowhere else: store errors map to 404 (NotFound), 409 (Conflict) and
422 (Invalid, BlobError); every refused request is counted in `sparecycles_rejected_requests_total` by
reason. A background task marks workers whose lease expired as lost and re-issues the seeds of rounds
that stopped progressing (`coordinator.deadlines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from api.limits import BodyGuard
from api.routes import blobs, health, results, rounds, runs, teachers, workers
from coordinator.blobs import BlobError
from coordinator.deadlines import RoundWatch
from coordinator.errors import Conflict, CoordinatorError, Invalid, NotFound, TooMany
from coordinator.intake import Intake
from coordinator.keys import redis_client_kwargs
from coordinator.metrics import CoordinatorMetrics
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from wire.round_messages import ResultBatch

log = logging.getLogger("sparecycles.api")

_STATUS = {NotFound: 404, Conflict: 409, Invalid: 422, TooMany: 429}


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


def _with_body_schemas(schema: dict, *models: type[BaseModel]) -> dict:
    """Add the JSON schemas of `models` (and their nested models) to an OpenAPI document's components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in body.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = body
    return schema


async def _wait_for_redis(client: AsyncRedis, n: int, restore: Callable[[], int] | None = None) -> None:
    """Wait until Redis answers (exponential backoff up to 5 s, one log line per attempt, no traceback),
    then open `n` pooled connections and run `restore` (re-creating lost broker users). Runs beside the
    server: /readyz answers 503 meanwhile."""

    def note(state: RetryCallState) -> None:
        log.warning("waiting for Redis: %s; /readyz is 503 until it answers", state.outcome.exception())

    async for attempt in AsyncRetrying(
        wait=wait_exponential(multiplier=0.25, max=5.0),
        retry=retry_if_exception_type((redis.RedisError, OSError, TimeoutError)),
        before_sleep=note,
    ):
        with attempt:
            await asyncio.wait_for(client.ping(), timeout=5.0)
    await _open_pool(client, n)
    if restore is not None:  # Redis may have restarted while the coordinator was down
        restored = await asyncio.to_thread(restore)
        if restored:
            log.warning("re-created %d workers' broker users the broker had lost", restored)


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
    metrics.attach_live(store.workers.worker_state_counts, store.dispatch.queue_depths, store.dispatch.outstanding_seeds,
                        store.shares.run_shares)
    intake = Intake(store, metrics)
    reaper = _reaper(settings, store, metrics, RoundWatch(store, intake.drop_spot_copy))
    clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    aredis = _async_redis_per_loop(settings, clients)
    lifespan = _lifespan(store, reaper, aredis, clients)

    app = FastAPI(title="sparecycles coordinator", version="1", lifespan=lifespan, **_fastapi_options())
    app.state.settings, app.state.store, app.state.metrics, app.state.intake = (
        settings,
        store,
        metrics,
        intake,
    )
    app.state.aredis = aredis
    app.add_middleware(BodyGuard)
    _document_body_schemas(app)
    app.state.token_cache = {}
    _add_exception_handlers(app, metrics)

    # The hot path first: routes are matched in registration order.
    for router in (results.router, health.router, workers.router, runs.router, blobs.router, rounds.router,
                   teachers.router):
        app.include_router(router)
    return app


def _reaper(
    settings: CoordinatorSettings, store: Store, metrics: CoordinatorMetrics, watch: RoundWatch
) -> Callable[[], Coroutine[None, None, None]]:
    """The lease reaper, a coroutine function run beside the server: every `settings.reaper_interval_s` seconds it
    re-creates the broker users a restarted broker forgot, retires the ended runs' queues from them once their window
    passed, marks workers whose lease expired as lost and re-issues the seeds of rounds past their deadline
    (`coordinator.deadlines`). A Redis outage logs one line and is retried; it never ends the task."""
    redis_run_id: list[str] = []

    def reap_and_watch() -> None:
        if store.workers.broker_acl is not None:
            # A restarted broker forgot the workers' ACL users (created at run time, not in its AOF).
            run_id = store.workers.broker_acl.server_run_id()
            if redis_run_id and run_id != redis_run_id[0]:
                log.warning("the broker restarted: %d broker users re-created", store.workers.restore_broker_users())
            redis_run_id[:] = [run_id]
            retired = store.workers.retire_ended_queues()
            if retired:
                log.info("retired the ended queues %s from the workers' broker users", ", ".join(retired))
                metrics.broker_retired.inc(len(retired))
        lost = store.workers.reap_expired()
        metrics.lost.inc(len(lost))
        if lost:
            watch.worker_lost()
        for _, _, tasks in watch.tick():
            metrics.redispatched.labels("deadline").inc(tasks)
            metrics.tasks_published.inc(tasks)

    async def reaper() -> None:
        failing = False
        while True:
            try:
                await run_in_threadpool(reap_and_watch)
                if failing:
                    log.warning("lease reaper: Redis is back")
                failing = False
            except (redis.RedisError, OSError) as exc:  # Redis unreachable: /readyz says so; keep trying
                if not failing:  # one line per outage, not one per tick
                    log.warning(
                        "lease reaper: Redis unreachable (%s); retrying every %.1f s",
                        exc,
                        settings.reaper_interval_s,
                    )
                failing = True
            await asyncio.sleep(settings.reaper_interval_s)

    return reaper


def _async_redis_per_loop(
    settings: CoordinatorSettings, clients: weakref.WeakKeyDictionary
) -> Callable[[], AsyncRedis]:
    """`aredis()`: the asyncio Redis client of the running event loop, created on first use and kept in
    `clients` (connections belong to the loop that opened them)."""

    def aredis() -> AsyncRedis:
        loop = asyncio.get_running_loop()
        if loop not in clients:
            clients[loop] = AsyncRedis.from_url(
                settings.redis_url, decode_responses=True, **redis_client_kwargs()
            )
        return clients[loop]

    return aredis


def _lifespan(
    store: Store,
    reaper: Callable[[], Coroutine[None, None, None]],
    aredis: Callable[[], AsyncRedis],
    clients: weakref.WeakKeyDictionary,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: starts waiting for Redis (then warming its pool) and the reaper beside the server;
    on shutdown cancels both and closes this loop's Redis client."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Serving starts at once; until Redis answers, /readyz is 503 and state calls 503 with Retry-After.
        tasks = [
            asyncio.create_task(
                _wait_for_redis(aredis(), WARM_REDIS_CONNECTIONS, store.workers.restore_broker_users)
            ),
            asyncio.create_task(reaper()),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            client = clients.pop(asyncio.get_running_loop(), None)
            if client is not None:
                await client.aclose()

    return lifespan


def _document_body_schemas(app: FastAPI) -> None:
    """Make the app's OpenAPI document (built once, on first request) include the ResultBatch body schema."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _with_body_schemas(FastAPI.openapi(app), ResultBatch)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_exception_handlers(app: FastAPI, metrics: CoordinatorMetrics) -> None:
    """Map store errors to 404/409/422/429 (else 400), BlobError and validation errors to 422 and a Redis outage
    to 503 with Retry-After; each refusal counted in `rejected_requests` by reason."""

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(request: Request, exc: CoordinatorError) -> JSONResponse:
        status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
        metrics.rejected_requests.labels(exc.reason).inc()
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, TooMany) else None
        return JSONResponse({"detail": str(exc)}, status_code=status, headers=headers)

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
