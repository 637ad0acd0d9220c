"""Broker isolation: one Redis ACL user per worker, limited to the Celery keys a worker needs.

Without it every enrolled worker receives the broker URL, which is the coordinator's own Redis
credentials: a worker could read every token digest or set its own state back from `quarantined`.
With `settings.broker_acl`, registration creates the user `<worker id>` with a fresh random password
(only its sha256 is stored by Redis) and hands the worker a broker URL with those credentials; the
user may touch only:

- exactly the queues of the runs registered at the coordinator, probe runs (`{queue_prefix}.{run}`) and teacher
  runs (`sparecycles.teacher.{run}`), each with kombu's priority sub-queues (`{queue}\\x06\\x16*`) and no
  other (BRPOP to take a task, LPUSH to hand one back): granted at registration for the runs then registered, and
  each new run's queue before any worker is told of it (`grant`); another run's queue is refused. An ended run's
  queue becomes write only (`%W~`, `set_keys`): taking from it (BRPOP, RPOP, LRANGE) is refused with NOPERM, while
  a task still in flight when the run ended can be handed back (kombu's requeue and visibility-timeout restore
  LPUSH/RPUSH it inside a MULTI; refused, the transaction would abort and leave the message in `unacked`, where
  every worker's restore sweep would fail on it). The worker's idle placeholder queue and Celery's default queue,
- kombu's bookkeeping: `_kombu.*` (queue bindings), `unacked`, `unacked_index`, `unacked_mutex`
  (late acknowledgement and the visibility-timeout restore),
- Celery's remote-control mailbox: `*.celery.pidbox*` (its own and the reply queue) and pub/sub channels,
- teacher answers, write only (`%W~`: SET, never GET/GETDEL), the target keys `sc:kd:*`,

with the command set `+@all -@admin -@dangerous` (no ACL, CONFIG, KEYS, FLUSHALL, DEBUG, ...).
Ending a run (or a teacher run) at the coordinator makes its queue write only for every user (`set_keys`); a
retirement window later (`settings.ended_queue_retire_timeouts` visibility timeouts: no task taken before the end is
held longer) the reaper drops that rule again (`set_keys`), so a long-lived coordinator's users do not keep one
pattern per run ever ended, and deletes what is left of the queue (`forget_queues`: tasks handed back meanwhile, and
the unacked entries of tasks whose worker died holding them, which a later restore sweep could no longer hand back).
Quarantine and expiry disable the user (`ACL SETUSER off` and its open connections killed); deletion
removes it. Passwords are derived from a coordinator secret (`worker_password`), so after a Redis
restart, which forgets users created at run time, `restore` re-creates the users of the workers that are
neither quarantined nor deleted, with the queues registered then (the coordinator does so when Redis comes back). Redis 6+/Valkey ACLs; the coordinator's own connection must be allowed `ACL` (the default
user is).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from coordinator.keys import redis_client_kwargs
from wire.teacher_messages import TARGET_KEY_PREFIX

KOMBU_KEYS = (
    "_kombu.*",
    "unacked",
    "unacked_index",
    "unacked_mutex",
    "*.celery.pidbox*",  # "*" after: kombu's priority sub-queues
)
# The worker's placeholder queue while no run exists, and Celery's default queue (probe_worker.worker,
# coordinator.celery_app): fixed names outside the queue prefix.
FIXED_QUEUES = ("sparecycles.idle*", "sparecycles.default*")  # "*": kombu's priority sub-queues
COMMANDS = "+@all -@admin -@dangerous"
TARGET_RULE = f"%W~{TARGET_KEY_PREFIX}*"  # teacher answers out, write only
PRIORITY_SEP = "\x06\x16"  # kombu's Redis transport names a queue's priority sub-queues "<queue>\x06\x16<n>"


def glob_escape(name: str) -> str:
    """`name` as a Redis glob pattern matching only itself (`*?[]\\` escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in name)


def queue_rules(queues: list[str], access: str = "~") -> list[str]:
    """The key rules granting exactly `queues` (and their priority sub-queues), nothing more; `access` "~" is
    read and write, "%W~" write only."""
    return [rule for q in queues
            for rule in (f"{access}{glob_escape(q)}", f"{access}{glob_escape(q + PRIORITY_SEP)}*")]


def worker_key_rules(queues: list[str], ended: Sequence[str] = ()) -> list[str]:
    """The key rules of a worker's broker user: `queues` (the live runs') read and write, the `ended` runs' queues
    write only (a task in flight at the end can be handed back, none taken), kombu's keys, the fixed queues and the
    target keys (write only)."""
    return [*queue_rules(queues), *queue_rules(list(ended), "%W~"), *(f"~{k}" for k in (*KOMBU_KEYS, *FIXED_QUEUES)),
            TARGET_RULE]


def worker_acl_rules(queues: list[str], password: str, ended: Sequence[str] = ()) -> list[str]:
    """The `ACL SETUSER` rules of a worker's broker user granted `queues`, and `ended` write only (pure: the policy
    in one place)."""
    return ["reset", "on", f">{password}", *worker_key_rules(queues, ended), "&*", *COMMANDS.split()]


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` with its user:password replaced (redis:// or rediss://)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def worker_password(secret: bytes, wid: str) -> str:
    """The broker password of worker `wid`: HMAC-SHA256(secret, "broker-user:" + wid), URL-safe base64.

    Derived rather than drawn, so the coordinator can re-create the users after a Redis restart (ACL users
    created at run time are not in the append-only file) without storing any password.
    """
    mac = hmac.new(secret, f"broker-user:{wid}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def _routing_key(raw: str) -> str | None:
    """The routing key of one kombu unacked entry (JSON [message, exchange, routing key]); None if not of that form
    (never ours to drop)."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], str) else None


class BrokerAcl:
    """Creates, disables and deletes the workers' broker users on the broker Redis at `admin_url`.

    `secret` (bytes) keys the password derivation (`worker_password`); the coordinator passes its admin
    token, so rotating that token rotates every worker's broker password at the next `restore`.
    """

    def __init__(self, admin_url: str, secret: bytes) -> None:
        self.admin_url, self._secret = admin_url, secret
        self.r = redis.Redis.from_url(admin_url, decode_responses=True, **redis_client_kwargs())

    def create(self, wid: str, queues: list[str], ended: Sequence[str] = ()) -> str:
        """Create (or reset) the user `wid` granted `queues` (and `ended` write only); return the broker URL the
        worker must use."""
        password = worker_password(self._secret, wid)
        self.r.execute_command("ACL", "SETUSER", wid, *worker_acl_rules(queues, password, ended))
        return with_credentials(self.admin_url, wid, password)

    def grant(self, wid: str, queues: list[str]) -> None:
        """Add `queues` to the existing user `wid`'s keys (its other rules unchanged)."""
        self.r.execute_command("ACL", "SETUSER", wid, *queue_rules(queues))

    def set_keys(self, wid: str, queues: list[str], ended: Sequence[str]) -> None:
        """Replace the existing user `wid`'s key rules by `worker_key_rules(queues, ended)` (Redis cannot take one
        pattern away: `resetkeys`, then the rules); its password, on/off state, commands and channels unchanged.
        The check applies to the user's open connections from their next command on."""
        self.r.execute_command("ACL", "SETUSER", wid, "resetkeys", *worker_key_rules(queues, ended))

    def forget_queues(self, queues: Sequence[str]) -> int:
        """Delete what is left on the broker of retired queues (their runs ended a retirement window ago): the lists
        (and priority sub-queues) and kombu's unacked entries that would hand a task back onto one of them. Returns
        how many unacked entries were dropped.

        Without their rule a hand-back onto them is refused (NOPERM) and would abort kombu's restore transaction,
        leaving the entry in `unacked` for every worker's restore sweep to fail on; removed here, a late ack or
        requeue of it finds nothing and does nothing (kombu's restore WATCHes `unacked` and re-reads). kombu keeps
        an entry as JSON [message, exchange, routing key] and restores it to the queues bound under that routing
        key; Celery and kombu bind a queue under its own name, so an entry belongs to the queue its routing key
        names."""
        gone = set(queues)
        tags = [tag for tag, raw in self.r.hscan_iter("unacked") if _routing_key(raw) in gone]
        pipe = self.r.pipeline(transaction=True)
        if tags:
            pipe.hdel("unacked", *tags)
            pipe.zrem("unacked_index", *tags)
        # kombu names a queue's priority sub-queues "<queue>\x06\x16<n>", n a priority step of 1..9 (priority 0
        # is the queue itself)
        pipe.delete(*(k for q in queues for k in (q, *(f"{q}{PRIORITY_SEP}{n}" for n in range(1, 10)))))
        pipe.execute()
        return len(tags)

    def users(self) -> set[str]:
        """The users the broker has now."""
        return set(self.r.execute_command("ACL", "USERS"))

    def server_run_id(self) -> str:
        """The broker server's run id (changes with every restart)."""
        return str(self.r.info("server")["run_id"])

    def restore(self, wids: list[str], queues: list[str], ended: Sequence[str] = ()) -> int:
        """Re-create the users of `wids` that the broker lost (a restart), granted `queues` (and `ended` write only);
        return how many were missing."""
        have = self.users()
        missing = [w for w in wids if w not in have]
        for wid in missing:
            self.create(wid, queues, ended)
        return len(missing)

    def disable(self, wid: str) -> None:
        """Refuse the user's logins and close its open connections (quarantine, expiry)."""
        self.r.execute_command("ACL", "SETUSER", wid, "off")
        self._kill(wid)

    def delete(self, wid: str) -> None:
        """Remove the user (and with it, its connections)."""
        self.r.execute_command("ACL", "DELUSER", wid)
        self._kill(wid)

    def _kill(self, wid: str) -> None:
        try:
            self.r.execute_command("CLIENT", "KILL", "USER", wid)
        except redis.ResponseError:  # "No such user" after DELUSER: nothing left to close
            pass
