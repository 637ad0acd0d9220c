"""Worker registry: registration (capped and rate-limited per enrollment token), hashed tokens, leases
renewed by heartbeats, drain/resume, loss and expiry.

A part of `coordinator.store.Store`, built with what it uses: the state Redis client, the key layout, the
settings, the runs and the teacher runs (`RunStore.queues()` and `TeacherRuns.queues()`: the queue lists workers
consume). Keys: `{prefix}:workers` (set of ids), `{prefix}:w:{id}` (hash), `{prefix}:leases`
(sorted set id -> lease expiry, unix seconds), `{prefix}:expiry` (lost workers -> when they are
deleted), `{prefix}:enrolled:{token id}` (workers enrolled with one enrollment token),
`{prefix}:enroll_rate:{token id}` (registrations in the current window).

Every state transition is one Lua script (`coordinator.worker_scripts`):

| transition | from | by |
|---|---|---|
| register -> active | - | enrollment token (cap `max_workers_per_enrollment`, `registrations_per_minute`) |
| heartbeat | any; lost -> active (or draining if drained before) | the worker |
| drain -> draining | active, draining, lost | admin, or the worker itself |
| resume -> active | active, draining | admin; the worker only if it drained itself |
| quarantine -> quarantined | active, draining, lost | intake (spot checks); left only by deletion |
| lose -> lost | active, draining, lease ended | the reaper |
| expire (deleted) | lost for `lost_expiry_leases` leases | the reaper |
| delete | any | admin, or the worker itself |

With `settings.broker_acl` each worker also gets its own broker user (`coordinator.broker_acl`):
created at registration with exactly the queues of the runs and teacher runs then registered, granted each new
run's queue before the workers are told of it (`grant_queue`), an ended run's queue made write only (`revoke_queue`:
none taken, a task in flight handed back), disabled at quarantine, removed with the record (deletion or expiry).
What was granted is kept in `{prefix}:broker_queues` (queue -> "rw" or "w"), so registration, a revocation and a
restore after a broker restart write the same rules; these changes hold one lock (`{prefix}:broker_acl_lock`), so a
revocation, which rewrites a user's key rules, never drops a grant made meanwhile (several coordinator processes).
A "w" mark is not kept for ever: `{prefix}:broker_queues_ended` records when each queue ended, and the reaper
(`retire_ended_queues`) drops the marks older than `settings.ended_queue_retire_s` (no task taken before the end is
held longer), rewrites the users' key rules once and deletes the queue's leftovers on the broker.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

import redis

from coordinator import worker_scripts
from coordinator.broker_acl import BrokerAcl
from coordinator.celery_app import PROBE_TASK_NAME
from coordinator.errors import Conflict, NotFound, TooMany
from coordinator.keys import Keys
from coordinator.runs import RunStore
from coordinator.settings import CoordinatorSettings
from coordinator.teachers import TeacherRuns
from wire.messages import (
    Heartbeat,
    HeartbeatReply,
    Lease,
    ServingFigures,
    WorkerInfo,
    WorkerRegistered,
    WorkerRegistration,
)

RATE_WINDOW_S = 60
ACL_LOCK_S = 60.0  # the broker users' lock expires after this (its holder died) and is waited for as long


def token_digest(token: str) -> str:
    """sha256 hex digest of a token (tokens carry 256 random bits, so an unsalted hash suffices)."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_worker_token(token: str) -> str | None:
    """The worker id a token claims (tokens are "w-<16 hex>.<secret>"), or None if malformed."""
    wid, _, secret = token.partition(".")
    if not secret or not wid.startswith("w-") or len(wid) != 18:
        return None
    return wid


def _new_worker_fields(reg: WorkerRegistration, token: str, enrolled_by: str, now: float,
                       expires: float) -> dict[str, object]:
    """A new worker's hash fields: state active, the token's sha256 (never the token), a first lease to `expires`
    (unix seconds), zeroed counters."""
    return {
        "name": reg.name,
        "device": reg.device,
        "host": reg.host,
        "state": "active",
        "token_sha256": token_digest(token),
        "enrolled_by": enrolled_by,
        "registered_at": now,
        "last_heartbeat": now,
        "lease_expires_at": expires,
        "busy": 0,
        "version": -1,
        "accepted": 0,
        "rejected": 0,
    }


def _refuse_registration(reply: list, s: CoordinatorSettings) -> None:
    """Raise TooMany for the REGISTER script's refusals: ["rate", seconds to wait] (registrations per minute of
    one enrollment token) or ["cap", workers held] (workers per enrollment token). Returns for any other reply."""
    if reply[0] == "rate":
        raise TooMany(
            f"more than {s.registrations_per_minute} registrations this minute with this enrollment "
            "token (SPARECYCLES_REGISTRATIONS_PER_MINUTE)",
            retry_after=max(1, int(reply[1])),
            reason="registration_rate",
        )
    if reply[0] == "cap":
        raise TooMany(
            f"this enrollment token already holds {reply[1]} workers, the cap "
            "(SPARECYCLES_MAX_WORKERS_PER_ENROLLMENT); delete workers or wait for lost ones to expire",
            retry_after=int(s.lease_seconds),
            reason="enrollment_cap",
        )


class WorkerRegistry:
    """Worker records and leases on Redis; transitions as in the module table."""

    def __init__(self, r: redis.Redis, keys: Keys, settings: CoordinatorSettings, runs: RunStore,
                 teachers: TeacherRuns) -> None:
        self.r, self.keys, self.settings, self.runs, self.teachers = r, keys, settings, runs, teachers
        # (worker id, now, active) -> the probe queues of its heartbeat; Store: by the runs' shares (coordinator.shares)
        self.probe_queues: Callable[[str, float, bool], list[str]] = lambda wid, now, active: self.runs.queues()

    @functools.cached_property
    def _scripts(self) -> dict:
        names = ("REGISTER", "HEARTBEAT", "TRANSITION", "MARK_LOST", "DELETE", "INCR_IF_EXISTS")
        return {n: self.r.register_script(getattr(worker_scripts, n)) for n in names}

    @functools.cached_property
    def broker_acl(self) -> BrokerAcl | None:
        """The workers' broker users (`settings.broker_acl`), or None when workers share the broker URL."""
        if not self.settings.broker_acl:
            return None
        secret = self.settings.admin_token.get_secret_value().encode()
        return BrokerAcl(self.settings.worker_broker_url, secret)

    def all_queues(self) -> list[str]:
        """Every queue a worker consumes now: the runs' probe queues and the teacher runs' queues."""
        return [*self.runs.queues(), *self.teachers.queues()]

    def _grantable(self) -> list[str]:
        """The workers whose broker users exist: registered and not quarantined."""
        wids = sorted(self.r.smembers(self.keys.k_workers))
        pipe = self.r.pipeline(transaction=False)
        for wid in wids:
            pipe.hget(self.keys.k_worker(wid), "state")
        return [w for w, st in zip(wids, pipe.execute(), strict=True) if st is not None and st != "quarantined"]

    def _acl_lock(self) -> redis.lock.Lock:
        """The lock of the broker users' key rules (one writer at a time over every coordinator process)."""
        return self.r.lock(self.keys.k_broker_acl_lock, timeout=ACL_LOCK_S, blocking_timeout=ACL_LOCK_S)

    def _granted_queues(self) -> tuple[list[str], list[str]]:
        """(queues granted read and write, ended queues granted write only), as recorded in `k_broker_queues`; the
        queues listed to workers now count as granted too (a run registered before the record existed)."""
        marks = self.r.hgetall(self.keys.k_broker_queues)
        ended = sorted(q for q, mark in marks.items() if mark == "w")
        live = set(self.all_queues()) | {q for q, mark in marks.items() if mark == "rw"}
        return sorted(live - set(ended)), ended

    def grant_queue(self, queue: str) -> None:
        """Grant a new run's `queue` to every worker's broker user (a no-op without `settings.broker_acl`); called
        before the queue is listed to the workers, so none is told to consume a queue its user is refused."""
        if self.broker_acl is not None:
            with self._acl_lock():
                self.r.hset(self.keys.k_broker_queues, queue, "rw")
                self.r.hdel(self.keys.k_broker_ended, queue)  # a run registered again under an ended run's name
                have = self.broker_acl.users()  # SETUSER on a user the broker lost would create it, off: restore's
                for wid in self._grantable():
                    if wid in have:
                        self.broker_acl.grant(wid, [queue])

    def revoke_queue(self, queue: str, now: float | None = None) -> int:
        """An ended run's `queue` becomes write only for every worker's broker user: taking a task from it is refused
        (NOPERM), handing one back that was in flight at the end is not (coordinator.broker_acl). Called after the
        queue left the list workers consume; a worker still consuming it until its next control tick leaves it when
        refused (probe_worker.broker). Every other grant stays. `now` (unix seconds) is recorded as the end, from
        which `retire_ended_queues` counts its window (a repeated end keeps the first). Idempotent; returns the users
        whose grant was withdrawn now (0 when the queue had ended before, or without `settings.broker_acl`)."""
        if self.broker_acl is None:
            return 0
        now = time.time() if now is None else now
        with self._acl_lock():
            before = self.r.hget(self.keys.k_broker_queues, queue)
            self.r.hset(self.keys.k_broker_queues, queue, "w")
            self.r.hsetnx(self.keys.k_broker_ended, queue, now)
            live, ended = self._granted_queues()
            have = self.broker_acl.users()  # a user the broker lost is re-created by restore, never here
            wids = [w for w in self._grantable() if w in have]
            for wid in wids:  # rewritten again on a repeated end: a revocation cut short is completed
                self.broker_acl.set_keys(wid, live, ended)
        return 0 if before == "w" else len(wids)

    def retire_ended_queues(self, now: float | None = None) -> list[str]:
        """Retire the ended queues whose run ended `settings.ended_queue_retire_s` or more before `now` (unix
        seconds): their "w" marks are dropped, every worker's broker user is rewritten once without them (`set_keys`)
        and their leftovers on the broker are deleted (`BrokerAcl.forget_queues`). Returns the queues retired, sorted
        ([] without `settings.broker_acl`). Called by the reaper on every tick: when nothing is due it reads two
        hashes and takes no lock; under the lock it reads them again, so concurrent reapers retire a queue once.

        A "w" mark without an end time (written before ends were recorded) is given `now`, so it is retired one
        window later."""
        if self.broker_acl is None:
            return []
        now = time.time() if now is None else now
        if not self._due_queues(now):
            return []
        with self._acl_lock():
            due = self._due_queues(now)
            if not due:
                return []
            live, ended = self._granted_queues()
            kept = [q for q in ended if q not in due]
            have = self.broker_acl.users()  # a user the broker lost is re-created by restore, never here
            for wid in self._grantable():
                if wid in have:
                    self.broker_acl.set_keys(wid, live, kept)
            # After the rules: a hand-back that lands before them is deleted here, one refused after them leaves its
            # entry in `unacked`, dropped here too. The marks go last, so a retirement cut short is done again.
            self.broker_acl.forget_queues(due)
            self.r.hdel(self.keys.k_broker_queues, *due)
            self.r.hdel(self.keys.k_broker_ended, *due)
        return due

    def _due_queues(self, now: float) -> list[str]:
        """The "w"-marked queues that ended `settings.ended_queue_retire_s` or more before `now`; a mark without an
        end time is stamped `now` (its window starts here)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.k_broker_queues)
        pipe.hgetall(self.keys.k_broker_ended)
        marks, ended_at = pipe.execute()
        ended = [q for q, mark in marks.items() if mark == "w"]
        for q in ended:
            if q not in ended_at:
                self.r.hsetnx(self.keys.k_broker_ended, q, now)
        cutoff = now - self.settings.ended_queue_retire_s
        return sorted(q for q in ended if q in ended_at and float(ended_at[q]) <= cutoff)

    def restore_broker_users(self) -> int:
        """Re-create the broker users a restarted Redis forgot (workers not quarantined); returns how many.
        A no-op without `settings.broker_acl`."""
        if self.broker_acl is None:
            return 0
        with self._acl_lock():
            return self.broker_acl.restore(self._grantable(), *self._granted_queues())

    def register_worker(
        self, reg: WorkerRegistration, now: float | None = None, enrolled_by: str = "default"
    ) -> WorkerRegistered:
        """Create a worker with a fresh id and token (token stored as its sha256) and a first lease.

        `enrolled_by` names the enrollment token (its sha256 prefix). Raises TooMany when that token
        enrolled `registrations_per_minute` workers in the current minute, or holds
        `max_workers_per_enrollment` workers (lost ones count until they expire).
        """
        now = time.time() if now is None else now
        wid = "w-" + secrets.token_hex(8)
        token = f"{wid}.{secrets.token_urlsafe(32)}"
        expires = now + self.settings.lease_seconds
        fields = _new_worker_fields(reg, token, enrolled_by, now, expires)
        s = self.settings
        keys = [
            self.keys.k_worker(wid),
            self.keys.k_workers,
            self.keys.k_leases,
            self.keys.k_enrolled(enrolled_by),
            f"{self.keys.p}:enroll_rate:{enrolled_by}",
        ]
        argv = [wid, expires, s.max_workers_per_enrollment, s.registrations_per_minute, RATE_WINDOW_S]
        argv += [x for kv in fields.items() for x in kv]
        reply = self._scripts["REGISTER"](keys=keys, args=argv)
        _refuse_registration(reply, s)
        broker_url = self.settings.worker_broker_url
        if self.broker_acl is not None:
            with self._acl_lock():
                broker_url = self.broker_acl.create(wid, *self._granted_queues())
        queues, teacher_queues = self.runs.queues(), self.teachers.queues()
        return WorkerRegistered(
            worker_id=wid,
            worker_token=token,
            broker_url=broker_url,
            queues=queues,
            teacher_queues=teacher_queues,
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
        stored = self.r.hget(self.keys.k_worker(wid), "token_sha256")
        if stored is None or not hmac.compare_digest(stored, token_digest(token)):
            return None
        return wid

    def heartbeat(self, wid: str, hb: Heartbeat, now: float | None = None) -> HeartbeatReply:
        """Renew the lease (one script); a lost worker comes back. Raises NotFound for an unknown worker."""
        now = time.time() if now is None else now
        expires = now + self.settings.lease_seconds
        keys = [self.keys.k_worker(wid), self.keys.k_leases, self.keys.k_expiry]
        args = [wid, now, expires, int(hb.busy), -1 if hb.version is None else hb.version]
        if (state := self._scripts["HEARTBEAT"](keys=keys, args=args)) is None:
            raise NotFound(f"unknown worker {wid}")
        taking = state == "active"  # a worker yielding to its engine (its yielded_s grew) takes no task either
        if hb.serving is not None:  # the worker's figures beside a serving engine, shown in GET /v1/workers
            prev = self.r.hget(keys[0], "serving")
            taking &= prev is None or hb.serving.yielded_s <= ServingFigures.model_validate_json(prev).yielded_s
            self.r.hset(keys[0], "serving", hb.serving.model_dump_json())
        lease = Lease(worker_id=wid, expires_at=expires, lease_seconds=self.settings.lease_seconds)
        return HeartbeatReply(lease=lease, state=state, queues=self.probe_queues(wid, now, taking),
                              teacher_queues=self.teachers.queues())

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Mark workers whose lease ended before `now` as lost, and delete workers lost for
        `lost_expiry_leases` leases; return the ids newly marked lost.

        Each step is one script that re-checks its condition, so a heartbeat racing the reaper wins
        and concurrent reapers act once. Celery redelivers a lost worker's unacked task after the
        visibility timeout.
        """
        now = time.time() if now is None else now
        expire_at = now + self.settings.lost_expiry_leases * self.settings.lease_seconds
        lost = []
        for wid in self.r.zrangebyscore(self.keys.k_leases, "-inf", now, start=0, num=1000):
            keys = [self.keys.k_worker(wid), self.keys.k_leases, self.keys.k_expiry]
            if self._scripts["MARK_LOST"](keys=keys, args=[wid, now, expire_at]):
                lost.append(wid)
        for wid in self.r.zrangebyscore(self.keys.k_expiry, "-inf", now, start=0, num=1000):
            self._delete(wid, required_state="lost")
            self.r.zrem(self.keys.k_expiry, wid)  # a worker that came back is no longer due
        return lost

    def set_worker_state(
        self, wid: str, state: str, allowed_from: tuple[str, ...], actor: str = "admin"
    ) -> str:
        """Change a worker's state if its current state is in `allowed_from` (one script); `actor` is
        admin, worker (the worker itself) or coordinator. Raises NotFound, or Conflict for a disallowed
        transition (a worker resuming an admin's drain included). Returns the new state."""
        reply = self._scripts["TRANSITION"](
            keys=[self.keys.k_worker(wid)], args=[state, actor, ",".join(allowed_from)]
        )
        if reply[0] == "missing":
            raise NotFound(f"unknown worker {wid}")
        if reply[0] == "admin_drain":
            raise Conflict(f"worker {wid} was drained by an admin; only an admin can resume it")
        if reply[0] == "conflict":
            raise Conflict(f"worker {wid} is {reply[1]}; cannot become {state}")
        if state == "quarantined" and self.broker_acl is not None:
            self.broker_acl.disable(wid)  # its broker credentials stop working, open connections closed
        return state

    def count_on_worker(self, wid: str, field: str, n: int) -> None:
        """Add `n` to a counter of an existing worker record (never creates a record)."""
        self._scripts["INCR_IF_EXISTS"](keys=[self.keys.k_worker(wid)], args=[field, n])

    def _delete(self, wid: str, required_state: str = "") -> bool:
        keys = [self.keys.k_worker(wid), self.keys.k_workers, self.keys.k_leases, self.keys.k_expiry]
        args = [wid, required_state, f"{self.keys.p}:enrolled:"]
        deleted = self._scripts["DELETE"](keys=keys, args=args) is not None
        if deleted and self.broker_acl is not None:
            self.broker_acl.delete(wid)
        return deleted

    def delete_worker(self, wid: str) -> None:
        """Forget a worker (one script; its token stops working). Raises NotFound."""
        if not self._delete(wid):
            raise NotFound(f"unknown worker {wid}")

    def worker_info(self, wid: str) -> WorkerInfo:
        """One worker's record. Raises NotFound, also for an incomplete record (see worker_scripts)."""
        return self._worker_info(wid, self.r.hgetall(self.keys.k_worker(wid)))

    @staticmethod
    def _worker_info(wid: str, h: dict) -> WorkerInfo:
        try:
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
                serving=ServingFigures.model_validate_json(h["serving"]) if h.get("serving") else None,
            )
        except (KeyError, ValueError):  # absent, or not written by a registry script: read as absent
            raise NotFound(f"unknown worker {wid}") from None

    def list_workers(self, after: str = "", limit: int = 100) -> tuple[list[WorkerInfo], str | None]:
        """Up to `limit` workers with id > `after`, sorted by id; returns (page, cursor of the next page or
        None). The id set is bounded by the enrollment cap, so sorting it per page is cheap."""
        ids = sorted(self.r.smembers(self.keys.k_workers))
        page = ids[bisect.bisect_right(ids, after) :][:limit] if after else ids[:limit]
        pipe = self.r.pipeline(transaction=False)
        for wid in page:
            pipe.hgetall(self.keys.k_worker(wid))
        out = []
        for wid, h in zip(page, pipe.execute()):
            try:
                out.append(self._worker_info(wid, h))
            except NotFound:
                continue
        more = page and ids[-1] > page[-1]
        return out, (page[-1] if more else None)

    def live_workers(self, exclude: set[str] | frozenset[str] = frozenset()) -> int:
        """Workers that hold a lease and can take tasks now or after a drain (active or draining), not in
        `exclude` (worker ids)."""
        wids = [w for w in self.r.smembers(self.keys.k_workers) if w not in exclude]
        pipe = self.r.pipeline(transaction=False)
        for wid in wids:
            pipe.hget(self.keys.k_worker(wid), "state")
        return sum(1 for state in pipe.execute() if state in ("active", "draining"))

    def idle_workers(self) -> int:
        """Active workers whose last heartbeat said they were not busy."""
        wids = list(self.r.smembers(self.keys.k_workers))
        pipe = self.r.pipeline(transaction=False)
        for wid in wids:
            pipe.hmget(self.keys.k_worker(wid), ["state", "busy"])
        return sum(1 for state, busy in pipe.execute() if state == "active" and busy == "0")

    def worker_state_counts(self) -> dict[str, int]:
        """Number of workers per state (for the `sparecycles_workers` gauge)."""
        counts = {"active": 0, "draining": 0, "lost": 0, "quarantined": 0}
        pipe = self.r.pipeline()
        for wid in self.r.smembers(self.keys.k_workers):
            pipe.hget(self.keys.k_worker(wid), "state")
        for state in pipe.execute():
            if state in counts:
                counts[state] += 1
        return counts
