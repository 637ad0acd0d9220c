"""The trainer's side of result delivery: a Redis Streams consumer-group reader (no torch).

Intake appends `StreamEvent`s to `{prefix}:{run}:results`. The trainer reads them through a consumer
group with explicit acknowledgement, so a trainer restart loses nothing: on start the reader first
re-reads its own pending (delivered, unacked) entries, then claims entries abandoned by other
consumers for longer than `claim_idle_ms` (XAUTOCLAIM), then reads new ones. Reads and acks retry through
a Redis outage of up to `outage_s` seconds; a stream or group that is gone (Redis came back empty) is re-created
and reported as `StreamLost`.
"""

from __future__ import annotations

import logging

import redis
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from coordinator.errors import Unavailable
from coordinator.keys import results_stream_key
from wire.round_messages import StreamEvent

log = logging.getLogger("sparecycles.stream")


class StreamLost(RuntimeError):
    """The run's results stream or its consumer group was gone (Redis came back empty, a failover, a flush): the
    group is re-created, but what the coordinator knew of the run is lost (fleet.recovery re-creates the run)."""


class ResultStreamReader:
    """Consumer `consumer` of group `group` on run `run`'s result stream.

    `read()` returns [(entry_id, StreamEvent)]; call `ack(ids)` once an event is durably used. Duplicate
    delivery of the same entry is possible after a crash between use and ack; entries are unique per
    (round, seed) for `accepted` events, so callers dedupe on that key.
    """

    def __init__(
        self,
        redis_url: str,
        run: str,
        *,
        group: str = "trainer",
        consumer: str = "trainer-0",
        key_prefix: str = "sc",
        claim_idle_ms: int = 60_000,
        outage_s: float = 60.0,
    ) -> None:
        if claim_idle_ms <= 0:
            raise ValueError("claim_idle_ms must be positive (milliseconds)")
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.key = results_stream_key(key_prefix, run)
        self.group, self.consumer, self.claim_idle_ms = group, consumer, claim_idle_ms
        self.outage_s = outage_s
        self._own_pending_done = False
        self.groups_recreated = 0  # times the stream or its group was gone (the store lost its state) and re-created
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the stream (empty) and the consumer group reading it from its start, unless they exist."""
        try:
            self.r.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _regrouping(self, fn):
        """`fn()`; when Redis says the stream's group is gone (NOGROUP: Redis came back empty, a failover, a flush),
        re-create it (reading from the stream's start, where intake appends the re-created run's results) and raise
        StreamLost: what was pending is gone, and the caller's run with it (fleet.recovery re-creates it)."""
        try:
            return self._retrying(fn)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            lost = exc
        log.warning("results stream %s: its consumer group is gone (the store lost its state); re-created", self.key)
        self.groups_recreated += 1
        self._own_pending_done = False
        self._retrying(self.ensure_group)
        raise StreamLost(f"the results stream {self.key} and its consumer group were gone (re-created)") from lost

    @staticmethod
    def _parse(entries: list) -> list[tuple[str, StreamEvent]]:
        return [(eid, StreamEvent.model_validate_json(fields["e"])) for eid, fields in entries if fields]

    def _retrying(self, fn):
        # A Redis restart or a short network outage: retry with backoff for `outage_s` seconds, then
        # give up with a clear error (trainer.train checkpoints on it).
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
                stop=stop_after_delay(self.outage_s),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                before_sleep=lambda st: log.warning(
                    "results stream: Redis unreachable (%s); retrying", st.outcome.exception()
                ),
                reraise=True,
            ):
                with attempt:
                    return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"Redis unreachable for {self.outage_s:.0f} s ({exc}); giving up") from exc
        raise AssertionError("unreachable")

    def read(self, count: int = 1000, block_ms: int = 1000) -> list[tuple[str, StreamEvent]]:
        """Up to `count` events, waiting at most `block_ms` milliseconds for new ones (0: not at all, what is
        there now; a blocking read of even 1 ms returns only at the server's timer tick, ~30 ms on Redis 7 here).

        Retries through a Redis outage of up to `outage_s` seconds; raises `coordinator.errors.Unavailable`
        (a ConnectionError) past that, StreamLost when the stream's group was gone (then re-created).
        """
        return self._regrouping(lambda: self._read(count, block_ms))

    def _read(self, count: int, block_ms: int) -> list[tuple[str, StreamEvent]]:
        if not self._own_pending_done:
            got = self.r.xreadgroup(self.group, self.consumer, {self.key: "0"}, count=count)
            entries = got[0][1] if got else []
            if entries:
                return self._parse(entries)
            self._own_pending_done = True
        claimed = self.r.xautoclaim(
            self.key, self.group, self.consumer, self.claim_idle_ms, "0-0", count=count
        )
        if claimed[1]:
            return self._parse(claimed[1])
        got = self.r.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=count,
                                block=block_ms if block_ms > 0 else None)  # redis-py: block=0 waits forever
        return self._parse(got[0][1]) if got else []

    def ack(self, ids: list[str]) -> int:
        """Acknowledge entries; returns how many were pending (retried through an outage as `read`)."""
        return int(self._regrouping(lambda: self.r.xack(self.key, self.group, *ids))) if ids else 0

    def pending(self) -> int:
        """Entries delivered to the group but not yet acknowledged."""
        return int(self.r.xpending(self.key, self.group)["pending"])

    def trim(self) -> int:
        """Delete entries every consumer of the group has acknowledged; returns how many were removed."""
        info = self.r.xpending(self.key, self.group)
        if info["pending"]:
            min_id = info["min"]
        else:
            groups = {g["name"]: g for g in self.r.xinfo_groups(self.key)}
            last = groups[self.group]["last-delivered-id"]
            ms, seq = (int(x) for x in last.split("-"))
            min_id = f"{ms}-{seq + 1}"
        return int(self.r.xtrim(self.key, minid=min_id))
