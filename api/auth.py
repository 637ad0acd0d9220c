"""Bearer-token authentication and role checks for the REST API.

Three roles: `admin` (runs, versions, rounds, blobs upload, worker management), `enroll` (joining the
fleet), `worker` (its own heartbeat, results, downloads). A missing, malformed or unknown token is 401
(with `WWW-Authenticate: Bearer`); a valid token of the wrong role, or a worker acting on another
worker, is 403.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Literal

from fastapi import HTTPException, Request

from coordinator.registry import parse_worker_token, token_digest

Role = Literal["admin", "enroll", "worker"]
# A verified worker token is trusted for this many seconds without a Redis read. DELETE through this
# process invalidates it at once; another coordinator process notices a deletion within this delay.
TOKEN_CACHE_S = 5.0


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: a role and, for workers, their id."""

    role: Role
    worker_id: str | None = None
    token_id: str | None = None  # enrollment tokens: sha256 prefix, the key of their cap and rate


def _reject(request: Request, status: int, reason: str, detail: str) -> HTTPException:
    request.app.state.metrics.rejected_requests.labels(reason).inc()
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return HTTPException(status_code=status, detail=detail, headers=headers)


async def principal(request: Request) -> Principal:
    """Resolve the Authorization header to a Principal. Raises HTTPException 401 on failure.

    Worker tokens are checked against the stored sha256 with one async Redis read (no thread hop),
    then cached for `TOKEN_CACHE_S` seconds.
    """
    known = getattr(request.state, "principal", None)  # resolved by api.limits.BodyGuard already
    if known is not None:
        return known
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        raise _reject(request, 401, "unauthenticated", "missing or malformed bearer token")
    settings = request.app.state.settings
    if hmac.compare_digest(token.encode(), settings.admin_token.get_secret_value().encode()):
        return Principal("admin")
    if hmac.compare_digest(token.encode(), settings.enrollment_token.get_secret_value().encode()):
        return Principal("enroll", token_id=token_digest(token)[:16])
    digest = token_digest(token)
    cache: dict[str, tuple[str, float]] = request.app.state.token_cache
    hit = cache.get(digest)
    if hit is not None and hit[1] > time.monotonic():
        return Principal("worker", hit[0])
    wid = parse_worker_token(token)
    key = request.app.state.store.keys.k_worker(wid) if wid is not None else None
    stored = None if key is None else await request.app.state.aredis().hget(key, "token_sha256")
    if stored is None or not hmac.compare_digest(stored, digest):
        raise _reject(request, 401, "unauthenticated", "unknown token")
    if len(cache) > 100_000:
        cache.clear()
    cache[digest] = (wid, time.monotonic() + TOKEN_CACHE_S)
    return Principal("worker", wid)


def require(*roles: Role, self_worker: bool = False):
    """Dependency factory: the caller must have one of `roles`.

    With `self_worker=True` a worker is admitted only for the path parameter `worker_id` naming itself.
    """

    async def dependency(request: Request) -> Principal:
        p = await principal(request)
        if p.role not in roles:
            raise _reject(request, 403, "forbidden", f"this call needs a {' or '.join(roles)} token")
        if self_worker and p.role == "worker" and request.path_params.get("worker_id") != p.worker_id:
            raise _reject(request, 403, "forbidden", "a worker may act only on itself")
        return p

    return dependency
