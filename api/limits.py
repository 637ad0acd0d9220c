"""Authentication and a body-size limit before any request body is read (a pure ASGI middleware).

FastAPI reads and parses a route's body before its dependencies (the role checks of `api.auth`) run, and
Starlette buffers it whole: a client without a token could make the coordinator hold any amount of
memory. `BodyGuard` runs first for every method that carries a body (POST, PUT, PATCH, DELETE):

1. it authenticates the bearer token (401 before a byte of the body is read; the role checks in the
   routes still apply and reuse this principal);
2. it picks the limit of the route for that role (`body_limit`): blob uploads (admin) `max_blob_bytes`,
   other admin calls `max_admin_body_bytes`, a worker's results `max_results_body_bytes`, everything
   else `max_body_bytes` (all in `CoordinatorSettings`, bytes);
3. a declared Content-Length above the limit is refused at once; otherwise the stream is counted as it
   is received and refused when it passes the limit (chunked bodies have no Content-Length).

Refusals are 413 with the limit and the setting in the message, counted in
`sparecycles_rejected_requests_total{reason="body_too_large"}`. Uvicorn stops reading a socket whose
body the app does not consume (flow control), so an unread body costs no memory.
"""

from __future__ import annotations

import re

import redis
from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import principal
from coordinator.settings import CoordinatorSettings

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_RESULTS = re.compile(r"^/v1/runs/[^/]+/results$")


def body_limit(settings: CoordinatorSettings, path: str, role: str) -> tuple[int, str]:
    """(limit in bytes, name of its setting) for a request to `path` by a caller of `role`.

    The role caps the limit: only admins may send blobs or large documents, only workers results.
    """
    if role == "admin":
        if path == "/v1/blobs" or path.startswith("/v1/blobs/"):
            return settings.max_blob_bytes, "max_blob_bytes"
        return settings.max_admin_body_bytes, "max_admin_body_bytes"
    if role == "worker" and _RESULTS.match(path):
        return settings.max_results_body_bytes, "max_results_body_bytes"
    return settings.max_body_bytes, "max_body_bytes"


class BodyTooLarge(HTTPException):
    """413: the request body passed the route's limit (raised while it streams in)."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(
            status_code=413,
            detail=f"request body larger than {limit} bytes, the limit of this route "
            f"(SPARECYCLES_{setting.upper()})",
        )


class BodyGuard:
    """ASGI middleware: authenticate, then bound the body, before the app reads it (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        request = Request(scope)  # headers only: no `receive`, so nothing here can read the body
        state = request.app.state
        try:
            who = await principal(request)
        except HTTPException as exc:
            await JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)(scope, receive, send)
            return
        except redis.RedisError:
            state.metrics.rejected_requests.labels("redis_unavailable").inc()
            body = {"detail": "state store unavailable; retry"}
            await JSONResponse(body, 503, {"Retry-After": "1"})(scope, receive, send)
            return
        request.state.principal = who
        limit, setting = body_limit(state.settings, scope["path"], who.role)
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            state.metrics.rejected_requests.labels("body_too_large").inc()
            exc = BodyTooLarge(limit, setting)
            await JSONResponse({"detail": exc.detail}, 413, {"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    state.metrics.rejected_requests.labels("body_too_large").inc()
                    raise BodyTooLarge(limit, setting)
            return message

        await self.app(scope, bounded_receive, send)
