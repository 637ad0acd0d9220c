"""Worker registry: registration, hashed tokens, leases renewed by heartbeats, drain/resume, loss.

A mixin of `coordinator.store.Store` (it uses the store's Redis client `r`, `settings`, key helpers and
`queues()`). Keys: `{prefix}:workers` (set of ids), `{prefix}:w:{id}` (hash), `{prefix}:leases`
(sorted set id -> lease expiry in unix seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from coordinator.celery_app import PROBE_TASK_NAME
from coordinator.errors import Conflict, NotFound
from coordinator.messages import (
    Heartbeat,
    HeartbeatReply,
    Lease,
    WorkerInfo,
    WorkerRegistered,
    WorkerRegistration,
)


def token_digest(token: str) -> str:
    """sha256 hex digest of a token (tokens carry 256 random bits, so an unsalted hash suffices)."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_worker_token(token: str) -> str | None:
    """The worker id a token claims (tokens are "w-<16 hex>.<secret>"), or None if malformed."""
    wid, _, secret = token.partition(".")
    if not secret or not wid.startswith("w-") or len(wid) != 18:
        return None
    return wid


class WorkerRegistry:
    """Worker records and leases on Redis (mixed into `Store`)."""

    def register_worker(self, reg: WorkerRegistration, now: float | None = None) -> WorkerRegistered:
        """Create a worker with a fresh id and token (token stored as its sha256) and a first lease."""
        now = time.time() if now is None else now
        wid = "w-" + secrets.token_hex(8)
        token = f"{wid}.{secrets.token_urlsafe(32)}"
        expires = now + self.settings.lease_seconds
        fields = {
            "name": reg.name,
            "device": reg.device,
            "host": reg.host,
            "state": "active",
            "token_sha256": token_digest(token),
            "registered_at": now,
            "last_heartbeat": now,
            "lease_expires_at": expires,
            "busy": 0,
            "version": -1,
            "accepted": 0,
            "rejected": 0,
        }
        pipe = self.r.pipeline()
        pipe.hset(self.k_worker(wid), mapping=fields)
        pipe.sadd(self.k_workers, wid)
        pipe.zadd(self.k_leases, {wid: expires})
        pipe.execute()
        return WorkerRegistered(
            worker_id=wid,
            worker_token=token,
            broker_url=self.settings.worker_broker_url,
            queues=self.queues(),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            lease_seconds=self.settings.lease_seconds,
            visibility_timeout_s=self.settings.visibility_timeout_s,
            probe_task_name=PROBE_TASK_NAME,
        )

    def authenticate_worker(self, token: str) -> str | None:
        """Worker id owning `token`, or None (constant-time digest comparison)."""
        wid = parse_worker_token(token)
        if wid is None:
            return None
        stored = self.r.hget(self.k_worker(wid), "token_sha256")
        if stored is None or not hmac.compare_digest(stored, token_digest(token)):
            return None
        return wid

    def heartbeat(self, wid: str, hb: Heartbeat, now: float | None = None) -> HeartbeatReply:
        """Renew the lease; a worker marked lost by an expired lease becomes active again."""
        now = time.time() if now is None else now
        key = self.k_worker(wid)
        state = self.r.hget(key, "state")
        if state is None:
            raise NotFound(f"unknown worker {wid}")
        if state == "lost":
            state = "active"
        expires = now + self.settings.lease_seconds
        pipe = self.r.pipeline()
        pipe.hset(
            key,
            mapping={
                "state": state,
                "last_heartbeat": now,
                "lease_expires_at": expires,
                "busy": int(hb.busy),
                "version": -1 if hb.version is None else hb.version,
            },
        )
        pipe.zadd(self.k_leases, {wid: expires})
        pipe.execute()
        lease = Lease(worker_id=wid, expires_at=expires, lease_seconds=self.settings.lease_seconds)
        return HeartbeatReply(lease=lease, state=state, queues=self.queues())

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Mark workers whose lease expired before `now` as lost; return their ids.

        ZREM arbitrates between concurrent reapers: only the one that removed the lease marks it.
        Celery redelivers the lost worker's unacked task after the visibility timeout.
        """
        now = time.time() if now is None else now
        lost = []
        for wid in self.r.zrangebyscore(self.k_leases, "-inf", now):
            if self.r.zrem(self.k_leases, wid) and self.r.hget(self.k_worker(wid), "state") in (
                "active",
                "draining",
            ):
                self.r.hset(self.k_worker(wid), "state", "lost")
                lost.append(wid)
        return lost

    def set_worker_state(self, wid: str, state: str, allowed_from: tuple[str, ...]) -> str:
        """Change a worker's state if its current state is in `allowed_from`; return the new state."""
        current = self.r.hget(self.k_worker(wid), "state")
        if current is None:
            raise NotFound(f"unknown worker {wid}")
        if current not in allowed_from:
            raise Conflict(f"worker {wid} is {current}; cannot become {state}")
        self.r.hset(self.k_worker(wid), "state", state)
        return state

    def delete_worker(self, wid: str) -> None:
        """Forget a worker (its token stops working)."""
        if not self.r.delete(self.k_worker(wid)):
            raise NotFound(f"unknown worker {wid}")
        self.r.srem(self.k_workers, wid)
        self.r.zrem(self.k_leases, wid)

    def worker_info(self, wid: str) -> WorkerInfo:
        """One worker's record."""
        h = self.r.hgetall(self.k_worker(wid))
        if not h:
            raise NotFound(f"unknown worker {wid}")
        version = int(h["version"])
        return WorkerInfo(
            worker_id=wid,
            name=h["name"],
            device=h["device"],
            host=h["host"],
            state=h["state"],
            registered_at=float(h["registered_at"]),
            last_heartbeat=float(h["last_heartbeat"]),
            lease_expires_at=float(h["lease_expires_at"]),
            busy=h["busy"] == "1",
            version=None if version < 0 else version,
            accepted=int(h["accepted"]),
            rejected=int(h["rejected"]),
        )

    def list_workers(self) -> list[WorkerInfo]:
        """All registered workers, sorted by id."""
        out = []
        for wid in sorted(self.r.smembers(self.k_workers)):
            try:
                out.append(self.worker_info(wid))
            except NotFound:
                continue
        return out

    def worker_state_counts(self) -> dict[str, int]:
        """Number of workers per state (for the `sparecycles_workers` gauge)."""
        counts = {"active": 0, "draining": 0, "lost": 0, "quarantined": 0}
        pipe = self.r.pipeline()
        for wid in self.r.smembers(self.k_workers):
            pipe.hget(self.k_worker(wid), "state")
        for state in pipe.execute():
            if state in counts:
                counts[state] += 1
        return counts
