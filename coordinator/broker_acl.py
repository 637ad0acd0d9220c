"""Broker isolation: one Redis ACL user per worker, limited to the Celery keys a worker needs.

Without it every enrolled worker receives the broker URL, which is the coordinator's own Redis
credentials: a worker could read every token digest or set its own state back from `quarantined`.
With `settings.broker_acl`, registration creates the user `<worker id>` with a fresh random password
(only its sha256 is stored by Redis) and hands the worker a broker URL with those credentials; the
user may touch only:

- the run queues `{queue_prefix}.*` (BRPOP to take a task, LPUSH to hand one back), the worker's idle
  placeholder queue and Celery's default queue,
- kombu's bookkeeping: `_kombu.*` (queue bindings), `unacked`, `unacked_index`, `unacked_mutex`
  (late acknowledgement and the visibility-timeout restore),
- Celery's remote-control mailbox: `*.celery.pidbox*` (its own and the reply queue) and pub/sub channels,

with the command set `+@all -@admin -@dangerous` (no ACL, CONFIG, KEYS, FLUSHALL, DEBUG, ...).
Quarantine and expiry disable the user (`ACL SETUSER off` and its open connections killed); deletion
removes it. Redis 6+/Valkey ACLs; the coordinator's own connection must be allowed `ACL` (the default
user is).
"""

from __future__ import annotations

import secrets
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from coordinator.keys import redis_client_kwargs

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


def worker_acl_rules(queue_prefix: str, password: str) -> list[str]:
    """The `ACL SETUSER` rules of a worker's broker user (pure: the policy in one place)."""
    keys = [f"~{queue_prefix}.*", *(f"~{k}" for k in (*KOMBU_KEYS, *FIXED_QUEUES))]
    return ["reset", "on", f">{password}", *keys, "&*", *COMMANDS.split()]


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` with its user:password replaced (redis:// or rediss://)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class BrokerAcl:
    """Creates, disables and deletes the workers' broker users on the broker Redis at `admin_url`."""

    def __init__(self, admin_url: str, queue_prefix: str) -> None:
        self.admin_url, self.queue_prefix = admin_url, queue_prefix
        self.r = redis.Redis.from_url(admin_url, decode_responses=True, **redis_client_kwargs())

    def create(self, wid: str) -> str:
        """Create (or reset) the user `wid`; return the broker URL the worker must use."""
        password = secrets.token_urlsafe(32)
        self.r.execute_command("ACL", "SETUSER", wid, *worker_acl_rules(self.queue_prefix, password))
        return with_credentials(self.admin_url, wid, password)

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
