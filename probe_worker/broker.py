"""A kombu Redis transport that drops undecodable queue items instead of crashing the worker.

kombu's Redis channel pops a raw list item (BRPOP/RPOP), parses it as JSON and builds a Message from its
envelope (`properties`, `body`, `delivery_tag`, `delivery_info`) *before* Celery's own decode-error
handling sees anything; a parse error there escapes the event loop and Celery exits with "Unrecoverable
error". With a broker ACL every enrolled worker may write probe queues, so one bad item (not JSON, JSON
that is not an object, an object without the envelope) could take down every worker reading that queue.

`GuardedRedisTransport` (selected by `use_guarded_transport`) checks each item by kind: an item that is
not UTF-8 JSON, or not a kombu envelope, is dropped (it is already popped, and never reaches the unacked
set, so nothing redelivers it), logged once and counted in `sparecycles_worker_rejected_messages_total
{reason="undecodable"|"not_envelope"}`; the worker keeps consuming. Envelopes whose *body* is bad still go
to Celery, which rejects them itself.

A queue the broker no longer lets this worker take from (its run ended at the coordinator, which withdrew it from the
worker's broker user: coordinator.broker_acl) refuses the whole BRPOP with NOPERM, which would likewise end the worker
("Unrecoverable error") in the moments before its control loop stops consuming that queue. The channel then finds
the refused queues (LINDEX, which needs the same read permission and takes nothing), logs them once and leaves them
out of its BRPOP until Celery cancels them; the other queues are taken from as before.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import urlparse

import redis
from celery import Celery
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Message as VirtualMessage
from kombu.utils.scheduling import round_robin_cycle

from probe_worker.metrics import default_metrics
from wire.teacher_messages import TEACHER_QUEUE_PREFIX

log = logging.getLogger(__name__)

GUARDED_TRANSPORT = "probe_worker.broker:GuardedRedisTransport"
TEACHER_FIRST = "probe_worker.broker:TeacherFirstCycle"  # kombu's `queue_order_strategy` (broker_app sets it)


class UndecodableItem(Exception):
    """A queue item that is not a kombu message envelope; `reason` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def envelope_problem(payload: Any) -> str | None:
    """Why `payload` (a JSON-decoded queue item) is not a kombu envelope, or None if it is one."""
    if not isinstance(payload, dict):
        return f"JSON {type(payload).__name__}, not an object"
    props = payload.get("properties")
    if not isinstance(props, dict):
        return "no 'properties' object"
    if not isinstance(payload.get("body"), str):
        return "no string 'body'"
    if not isinstance(props.get("delivery_tag"), str) or not props["delivery_tag"]:
        return "no 'properties.delivery_tag' string"
    info = props.get("delivery_info")
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("exchange", "routing_key")):
        return "no 'properties.delivery_info' with string exchange and routing_key"
    return None


class GuardedMessage(VirtualMessage):
    """kombu's virtual Message, but a malformed envelope raises UndecodableItem (not KeyError/TypeError)."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        problem = envelope_problem(payload)
        if problem is not None:
            raise UndecodableItem("not_envelope", problem)
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except (KeyError, TypeError, ValueError) as exc:  # e.g. a body_encoding that does not decode
            raise UndecodableItem("not_envelope", f"{type(exc).__name__}: {exc}") from exc


class GuardedRedisChannel(kombu_redis.Channel):
    """kombu's Redis channel that drops (logs, counts) undecodable items instead of raising out of the loop."""

    Message = GuardedMessage

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._refused: set[str] = set()  # queues the broker refused this user (`_leave_refused`)
        super().__init__(*args, **kwargs)

    @property
    def active_queues(self) -> list[str]:
        """kombu's consumed queues, less those the broker refused (the BRPOP and its queue cycle read this)."""
        return [q for q in super().active_queues if q not in self._refused]

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        self._refused.discard(queue)  # consumed again: granted again (the coordinator grants a queue before it lists it)
        return super().basic_consume(queue, *args, **kwargs)

    def _leave_refused(self, exc: redis.exceptions.NoPermissionError) -> None:
        """The broker refused a BRPOP: leave out the consumed queues this user may no longer take from; re-raise
        `exc` when none is (a refusal of another kind stays fatal, as before)."""
        with self.conn_or_acquire() as client:
            refused = []
            for queue in super().active_queues:
                try:
                    client.lindex(queue, 0)
                except redis.exceptions.NoPermissionError:
                    refused.append(queue)
        if not refused:
            raise exc
        self._refused.update(refused)
        self._update_queue_cycle()
        log.warning("the broker refused this worker's user on %s (a run that ended at the coordinator); no longer "
                    "taking tasks from it", ", ".join(refused))

    def _drop(self, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, UndecodableItem) else "undecodable"
        default_metrics().rejected_messages.labels(reason).inc()
        log.warning("dropped an undecodable broker message (%s): %s", reason, str(exc)[:200])

    def _brpop_read(self, **options: Any) -> bool:
        # JSONDecodeError/UnicodeDecodeError come from kombu's parse of the popped item; UndecodableItem from
        # GuardedMessage, built before Celery's callback runs, so no task error is swallowed here.
        try:
            return super()._brpop_read(**options)
        except (json.JSONDecodeError, UnicodeDecodeError, UndecodableItem) as exc:
            self._drop(exc)
            return False
        except redis.exceptions.NoPermissionError as exc:
            self._leave_refused(exc)
            return False

    def _get(self, queue: str) -> Any:
        while True:  # the synchronous path (basic_get): skip bad items, return the next good one or Empty
            try:
                payload = super()._get(queue)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._drop(exc)
                continue
            problem = envelope_problem(payload)
            if problem is None:
                return payload
            self._drop(UndecodableItem("not_envelope", problem))


class TeacherFirstCycle(round_robin_cycle):
    """The order of a worker's BRPOP over its queues: every teacher queue (wire.teacher_messages.teacher_queue) before
    every probe queue, round-robin within each group (kombu moves the queue it took from to the end of the list).

    A worker consumes its run's probe queue (or the queue its share gives it) and every teacher run's queue. A
    student's step waits for its teacher targets, while a probe round only feeds curvature that folds when it comes,
    so with both kinds waiting the teacher round goes first. kombu's default (`round_robin`) would alternate them.
    Selected as the Redis transport's `queue_order_strategy` (kombu.utils.scheduling.cycle_by_name takes a path)."""

    def consume(self, n: int) -> list[str]:
        """The first `n` queues, teacher queues first, each group in the cycle's order."""
        items, prefix = self.items[:n], f"{TEACHER_QUEUE_PREFIX}."
        return sorted(items, key=lambda q: not q.startswith(prefix))  # stable: each group keeps the cycle's order


class GuardedRedisTransport(kombu_redis.Transport):
    """kombu's Redis transport using GuardedRedisChannel (driver type and URL parsing unchanged)."""

    Channel = GuardedRedisChannel


def use_guarded_transport(app: Celery, broker_url: str) -> bool:
    """Make `app` use GuardedRedisTransport when `broker_url` is plain redis://; returns whether it did.

    rediss:// keeps kombu's own transport: kombu turns on TLS from the scheme *name*, which an explicit
    transport class would hide.
    """
    if urlparse(broker_url).scheme != "redis":
        return False
    app.conf.broker_transport = GUARDED_TRANSPORT
    return True
