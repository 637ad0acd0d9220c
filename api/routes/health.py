"""Liveness, readiness and Prometheus metrics (no authentication)."""

from __future__ import annotations

import redis
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import MetricsD, StoreD

router = APIRouter()


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (says nothing about Redis)."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(store: StoreD) -> JSONResponse:
    """200 when Redis answers, else 503 with the reason."""
    try:
        store.ping()
    except redis.RedisError as exc:
        return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
def metrics_endpoint(metrics: MetricsD) -> Response:
    """Prometheus text exposition."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
def root() -> PlainTextResponse:
    return PlainTextResponse("sparecycles coordinator; see /docs\n")
