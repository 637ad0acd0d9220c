"""`ResultCollector`: a run's accepted probe results, read from its Redis Stream, each (round, seed) handed out
once (DESIGN.md §3, "Results").

The stream is read through the consumer group "trainer" (coordinator.stream.ResultStreamReader); entries are
acknowledged only when handed out, so a trainer restart loses nothing, and an entry re-read after a restart
or a claim is recognised and acknowledged, never handed out twice. Retractions (a quarantined worker's value)
and drops (spot checks with no majority) are the coordinator's decisions and are applied here. Stale and
duplicate results never reach the stream: intake decides them, and its counts (IntakeCounts) are reported
with the results.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from coordinator.client import CoordinatorClient
from trainer.console import raise_if_stopping
from trainer.zo.backend import COUNT_KEYS, Collected
from trainer.zo.probes import SeedResult

RoundSeed = tuple[str, int]
READ_BLOCK_MS = 200  # the longest read of a round's wait: the most a stop waits before the wait gives up


class ResultCollector:
    """Hands out the accepted results of one run; a part of fleet.backend.CoordinatorBackend.

    Args:
        client: the coordinator's HTTP client (the run's intake counts, read only by a collect that asks).
        run: the run's id. redis_url / key_prefix: the coordinator's state store and key prefix.
        consumer: this trainer's consumer name in the stream's group "trainer".
        claim_idle_ms: entries idle this long in another consumer are claimed (a crashed trainer's).
        round_timeout_s: default wait of `collect(round_id)` for a round to complete, seconds.
    """

    def __init__(self, client: CoordinatorClient, run: str, *, redis_url: str, key_prefix: str = "sc",
                 consumer: str = "trainer-0", claim_idle_ms: int = 60_000, round_timeout_s: float = 300.0) -> None:
        from coordinator.stream import ResultStreamReader

        self.client, self.run, self.round_timeout_s = client, run, round_timeout_s
        self.reader = ResultStreamReader(redis_url, run, consumer=consumer, key_prefix=key_prefix,
                                         claim_idle_ms=claim_idle_ms)
        seen = client.intake_counts(run)
        self._intake_seen = (seen.stale, seen.duplicate)  # the coordinator's counts already reported
        self.forward_passes = 0  # fleet forward passes behind the results handed out (2 per seed or the kind's
        # KindRule.forwards, +1 L0/round)
        self.waiting: dict[str, set[int]] = {}  # round -> seeds not yet handed out (nor dropped)
        self.buffered: dict[RoundSeed, tuple[str, SeedResult]] = {}  # (round, seed) -> (entry id, result)
        self._delivered: set[RoundSeed] = set()
        self._scales: dict[str, dict[int, float]] = {}  # along_update round -> block -> step RMS
        self._clean_counted: set[str] = set()
        self._forwards: dict[str, int] = {}  # round -> forward passes per seed, where not 2 (group_line: 1)
        self._counts: Counter[str] = Counter()  # dropped / retracted since the last collect

    def expect(self, round_id: str, seeds: list[int], scales: dict[int, float] | None = None,
               forwards: int = 2) -> None:
        """A round was sent: `collect(round_id)` waits for `seeds`; results carry `scales[seed]` (along_update);
        each seed's result stands for `forwards` forward passes (trainer.zo.probes.KindRule.forwards)."""
        if scales is not None:
            self._scales[round_id] = scales
        if forwards != 2:
            self._forwards[round_id] = forwards
        self.waiting[round_id] = set(seeds)

    def drain(self, block_ms: int) -> None:
        """Buffer the stream's accepted results (waiting up to `block_ms` for the first); apply retractions and
        drops (the coordinator's decisions)."""
        acks = []
        for entry_id, ev in self.reader.read(count=1000, block_ms=block_ms):
            key = (ev.round_id, ev.seed)
            if ev.kind == "accepted":
                if key in self.buffered and self.buffered[key][0] == entry_id:
                    continue  # our own pending entry re-read (claimed back after idling): still buffered
                if key in self.buffered or key in self._delivered:
                    acks.append(entry_id)  # an entry handed out before, re-read after a restart or claim
                    continue
                r = ev.result
                scale = self._scales.get(r.round_id, {}).get(r.seed)
                self.buffered[key] = (entry_id, SeedResult(
                    round_id=r.round_id, seed=r.seed, version=r.version, l_plus=r.l_plus, l_minus=r.l_minus, l0=r.l0,
                    scale=scale, worker=r.worker_id))
                continue
            acks.append(entry_id)
            if ev.kind == "retracted":
                self._counts["retracted"] += 1
                if self.buffered.pop(key, None) is None and key in self._delivered:
                    self._delivered.discard(key)  # already used; a fresh value follows
                    self.waiting.setdefault(ev.round_id, set()).add(ev.seed)
            else:
                self._counts["dropped"] += 1
                self.waiting.get(ev.round_id, set()).discard(ev.seed)
        self.reader.ack(acks)

    def _hand_out(self, keys: list[RoundSeed]) -> list[SeedResult]:
        out, acks = [], []
        for key in keys:
            entry_id, res = self.buffered.pop(key)
            self._delivered.add(key)
            self.forward_passes += self._forwards.get(key[0], 2)
            if res.l0 is not None and key[0] not in self._clean_counted:
                self._clean_counted.add(key[0])
                self.forward_passes += 1
            self.waiting.get(key[0], set()).discard(key[1])
            out.append(res)
            acks.append(entry_id)
        self.reader.ack(acks)
        return out

    def restart(self) -> None:
        """The run was created again on an empty store (fleet.recovery): the stream's consumer group is made again
        and the run's intake counts start again at 0."""
        self.reader.ensure_group()
        self._intake_seen = (0, 0)

    def awaits(self, round_id: str) -> bool:
        """Whether seeds of `round_id` are still awaited (`expect`ed, neither handed out nor dropped)."""
        return bool(self.waiting.get(round_id))

    def missing(self, round_id: str) -> set[int]:
        """The seeds of `round_id` still awaited (empty when none, or the round is unknown)."""
        return set(self.waiting.get(round_id, ()))

    def await_only(self, round_id: str, seeds: set[int]) -> None:
        """Await just `seeds` of `round_id` (a round re-issued after a loss: seeds handed out before are not
        awaited, nor used, again)."""
        self.waiting[round_id] = set(seeds)

    def forget(self, round_id: str) -> None:
        """Stop awaiting `round_id` (its owner no longer wants its results)."""
        self.waiting.pop(round_id, None)

    def _intake_counts(self) -> dict[str, int]:
        """Growth of the coordinator's stale/duplicate counts of this run since they were last reported."""
        info = self.client.intake_counts(self.run)
        stale, dup = self._intake_seen
        self._intake_seen = (info.stale, info.duplicate)
        return {"stale": info.stale - stale, "duplicate": info.duplicate - dup}

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0,
                poll: Callable[[], None] = lambda: None, counts: bool = False) -> Collected:
        """Accepted results not handed out before (only `round_id`'s if given), each (round, seed) once, with
        the counts since the last collect (keys COUNT_KEYS): `dropped`, `retracted` and `accepted` from the stream;
        `stale` and `duplicate` only with `counts` (one HTTP GET of the run's intake counts: what grew since they
        were last asked for), else 0 and left for the next collect that asks.

        With a `round_id` that was `expect`ed, waits up to `timeout_s` (0: round_timeout_s) until every seed
        of the round has arrived or was dropped, calling `poll()` between reads (it raises to stop waiting,
        e.g. when the round's upload failed); otherwise returns what is there now. A run that is stopping (the first
        Ctrl-C or SIGTERM of its step loop, trainer.console.STOP_REQUESTED) stops waiting within one read
        (READ_BLOCK_MS): trainer.console.StopWaiting, the results read so far staying buffered.
        """
        self.drain(block_ms=0)  # what is there now: a training step pays this (fleet.attach)
        if round_id is not None and round_id in self.waiting:
            deadline = time.monotonic() + (timeout_s or self.round_timeout_s)
            while (self.waiting[round_id] - {s for (r, s) in self.buffered if r == round_id}
                   and time.monotonic() < deadline):
                poll()
                raise_if_stopping(f"round {round_id} of run {self.run}")
                self.drain(block_ms=READ_BLOCK_MS)
        results = self._hand_out([k for k in self.buffered if round_id is None or k[0] == round_id])
        out = dict.fromkeys(COUNT_KEYS, 0)
        if counts:
            out.update(self._intake_counts())
        out.update(self._counts)
        out["accepted"] = len(results)
        self._counts.clear()
        return Collected(results, out)

    def close(self) -> None:
        """Close the Redis connection."""
        self.reader.r.close()
