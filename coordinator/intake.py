"""Result intake: validation, staleness bound, deduplication, spot checks, quarantine.

Every result gets exactly one outcome (`IntakeOutcome`), counted in `sparecycles_intake_results_total`.
A result is accepted only for an open round, one of its seeds, the round's version, finite values, a
round version within the staleness bound, a non-quarantined (and, if the run has a canary, attested)
worker; redeliveries are dropped by (round, seed, replica). Checks that depend on mutable state run in
one Lua script per batch, together with the dedupe (`HSETNX`) and the `XADD` to the run's stream, so a
crash can never record a result without streaming it or the reverse.

Spot checks (seeds chosen by `spot_check_selected`): replicas 0 and 1 are evaluated by different
workers and held back. If they agree within tolerance the value is streamed (verified). If not, the
seed goes to a third worker (replica 2); the replica that disagrees with the other two is the odd one
out, its worker is quarantined, and the majority value is streamed. Three-way disagreement streams a
`dropped` event (nobody is provably wrong). Quarantine retracts the worker's unverified accepted results
in open rounds (a `retracted` event) and re-dispatches those seeds; its later results are rejected and
their seeds re-dispatched too (bounded by `max_redispatch` per seed and replica). A spot check whose bound is
spent (no distinct worker took a replica) streams its values unverified if those not from quarantined workers
agree, else drops the seed: a quarantined liar's held value never costs the seed its honest one.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections import Counter
from collections.abc import Callable
from functools import lru_cache

from redis.asyncio import Redis as AsyncRedis

from coordinator.dispatch import spot_check_selected
from coordinator.errors import Conflict, NotFound
from coordinator.intake_scripts import INTAKE, PUBLISH, RETRACT
from coordinator.keys import results_stream_key
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import Store
from coordinator.worker_scripts import INCR_IF_EXISTS
from wire.round_messages import ProbeResult, ProbeRound, StreamEvent, values_agree

_REJECTED = ("quarantined", "unattested")


class Intake:
    """Applies intake rules to result batches against a `Store`, counting outcomes in `metrics`."""

    def __init__(self, store: Store, metrics: CoordinatorMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._intake = store.r.register_script(INTAKE)
        self._publish = store.r.register_script(PUBLISH)
        self._retract = store.r.register_script(RETRACT)
        self._round = lru_cache(maxsize=4096)(self._load_round)
        self._async_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def stream_key(self, run: str) -> str:
        """Redis Stream of the run's accepted-result events (field `e`: a `StreamEvent` JSON)."""
        return results_stream_key(self.store.keys.p, run)

    def _load_round(self, run: str, rid: str) -> tuple[ProbeRound, frozenset[int], float, float, float]:
        # Immutable round facts (the round document never changes once written), cached per process.
        rnd = self.store.rounds.get_round(run, rid)
        spec = self.store.runs.run_spec(run)
        fraction = spec.spot_check_fraction
        # Skipped without spot checks: a hash per seed of a large round stalls the event loop (~10 ms per 30k).
        # A round opened without spot checks (one live worker then: coordinator.rounds) has none, whatever the hash.
        spot = (
            frozenset(s for s in rnd.seeds if spot_check_selected(run, rid, s, fraction))
            if fraction > 0 and int(self.store.r.hget(self.store.keys.k_round(run, rid), "n_spot") or 0)
            else frozenset()
        )
        return rnd, spot, spec.spot_check_fraction, spec.spot_rtol, spec.spot_atol

    def submit(self, worker_id: str, run: str, results: list[ProbeResult]) -> list[str]:
        """Process results of `run` posted by `worker_id` (already authenticated); return outcomes in order.

        A result naming another worker or another run is `invalid`.
        """
        outcomes, calls = self._plan(worker_id, run, results)
        followups: list[Callable[[], None]] = []
        for rnd, keys, argv, sent in calls:
            followups += self._apply(rnd, sent, self._intake(keys=keys, args=argv), outcomes)
        for f in followups:
            f()
        rejected = self._tally(outcomes)
        if rejected:
            self.store.workers.count_on_worker(worker_id, "rejected", rejected)
        return outcomes

    async def submit_async(
        self, aredis: AsyncRedis, worker_id: str, run: str, results: list[ProbeResult]
    ) -> list[str]:
        """`submit` for an asyncio server: the per-batch Lua call goes through `aredis` (same Redis), the
        rare follow-ups (spot-check resolution, re-dispatch) run in a worker thread."""
        outcomes, calls = self._plan(worker_id, run, results)
        script = self._async_scripts.get(aredis)
        if script is None:  # one AsyncScript per client (it caches the SHA; EVALSHA then, EVAL on NOSCRIPT)
            script = self._async_scripts[aredis] = aredis.register_script(INTAKE)
        followups: list[Callable[[], None]] = []
        for rnd, keys, argv, sent in calls:
            followups += self._apply(rnd, sent, await script(keys=keys, args=argv), outcomes)
        if followups:
            await asyncio.to_thread(lambda: [f() for f in followups])
        rejected = self._tally(outcomes)
        if rejected:
            await aredis.eval(INCR_IF_EXISTS, 1, self.store.keys.k_worker(worker_id), "rejected", rejected)
        return outcomes

    async def submit_entries_async(
        self, aredis: AsyncRedis, worker_id: str, run: str, parsed: list[tuple[ProbeResult | None, str]]
    ) -> list[str]:
        """`submit_async` for entries validated one by one (`messages.parse_result`): valid ones go through
        intake; a `malformed` entry keeps that outcome; a `non_finite` one of this worker and run is
        counted as such and its seed re-issued (`_redispatch_seeds`, bounded; past the bound the seed is
        streamed as `dropped`, so the round is told). Outcomes are in entry order."""
        outcomes = [why for _, why in parsed]
        good = [i for i, (_, why) in enumerate(parsed) if not why]
        if good:
            sub = await self.submit_async(aredis, worker_id, run, [parsed[i][0] for i in good])
            for i, o in zip(good, sub):
                outcomes[i] = o
        bad = [i for i, (_, why) in enumerate(parsed) if why]
        retry: dict[str, list[tuple[int, int]]] = {}
        for i in bad:
            res = parsed[i][0]
            if res is None:
                continue
            if res.worker_id != worker_id or res.run != run:
                outcomes[i] = "invalid"
                continue
            retry.setdefault(res.round_id, []).append((res.seed, res.replica))
        if retry:
            await asyncio.to_thread(self._redispatch_reported, run, retry)
        rejected = self._tally([outcomes[i] for i in bad])
        if rejected:
            await aredis.eval(INCR_IF_EXISTS, 1, self.store.keys.k_worker(worker_id), "rejected", rejected)
        return outcomes

    def _redispatch_reported(self, run: str, pairs_by_round: dict[str, list[tuple[int, int]]]) -> None:
        # Seeds a worker reported as non-finite: re-issued if they belong to the round (and, for
        # replicas 1-2, are spot-checked); anything else is ignored (it was counted already).
        for rid, pairs in pairs_by_round.items():
            try:
                rnd, spot = self._round(run, rid)[:2]
            except NotFound:
                continue
            seeds = set(rnd.seeds)
            ok = [(s, r) for s, r in pairs if s in seeds and (r == 0 or s in spot)]
            if ok:
                self._redispatch_seeds(rnd, ok, "non_finite")

    def _tally(self, outcomes: list[str]) -> int:
        counts = Counter(outcomes)  # one metric update per distinct outcome, not per result
        for o, n in counts.items():
            self.metrics.results.labels(o).inc(n)
        return len(outcomes) - counts["accepted"] - counts["held"] - counts["duplicate"]

    def _plan(self, wid: str, run: str, results: list[ProbeResult]) -> tuple[list[str], list[tuple]]:
        """Stateless checks; returns outcomes so far and one (round, keys, argv, sent) Lua call per round."""
        outcomes: list[str] = [""] * len(results)
        groups: dict[str, list[int]] = {}
        for i, res in enumerate(results):
            if res.worker_id != wid or res.run != run:
                outcomes[i] = "invalid"
            else:
                groups.setdefault(res.round_id, []).append(i)
        calls = []
        for rid, idx in groups.items():
            try:
                rnd, spot, _, _, _ = self._round(run, rid)
            except NotFound:  # the run itself gone (e.g. its store was lost) is told apart from a stray round
                why = "unknown_round" if self.store.r.exists(self.store.keys.k_run(run, "run")) else "unknown_run"
                for i in idx:
                    outcomes[i] = why
                continue
            argv: list[str | int] = [wid, rnd.version]
            sent: list[tuple[int, ProbeResult]] = []
            for i in idx:
                res = results[i]
                mode = str(res.replica) if res.seed in spot else ("a" if res.replica == 0 else None)
                if mode is None or res.version != rnd.version or (rnd.want_clean and res.l0 is None):
                    outcomes[i] = "invalid"
                    continue
                if (
                    mode == "2"
                    and self.store.r.hget(self.store.keys.k_round(run, rid, "dec"), f"{res.seed}:pair")
                    != "disagree"
                ):
                    outcomes[i] = "invalid"  # a third evaluation is only legitimate after a disagreement
                    continue
                event = StreamEvent(kind="accepted", run=run, round_id=rid, seed=res.seed, result=res)
                argv += [res.seed, mode, event.model_dump_json() if mode == "a" else res.model_dump_json()]
                sent.append((i, res))
            if sent:
                s = self.store
                keys = [
                    s.keys.k_round(run, rid),
                    s.keys.k_round(run, rid, "seeds"),
                    s.keys.k_round(run, rid, "acc"),
                    self.stream_key(run),
                    s.keys.k_run(run, "run"),
                    s.keys.k_worker(wid),
                    s.keys.k_run(run, "attested"),
                    s.keys.k_round(run, rid, "spot"),
                ]
                calls.append((rnd, keys, argv, sent))
        return outcomes, calls

    def _apply(
        self, rnd: ProbeRound, sent: list[tuple[int, ProbeResult]], reply: list, outcomes: list[str]
    ) -> list[Callable[[], None]]:
        """Record the Lua reply's outcomes; return follow-ups (spot-check resolution, re-dispatch)."""
        head = reply[0]
        if head != "ok":
            for i, _ in sent:
                outcomes[i] = head
            if head in _REJECTED:
                pairs = [(res.seed, res.replica) for _, res in sent]
                return [lambda: self._redispatch_seeds(rnd, pairs, head)]
            return []
        age, done, n_seeds, created = int(reply[1]), int(reply[2]), int(reply[3]), reply[4]
        followups: list[Callable[[], None]] = []
        for (i, res), outcome in zip(sent, reply[5:]):
            outcomes[i] = outcome
            if outcome == "accepted":
                self.metrics.result_age.observe(age)
            elif outcome == "held":
                followups.append(lambda seed=res.seed: self._resolve(rnd, seed))
            elif outcome == "same_worker":
                followups.append(
                    lambda sr=(res.seed, res.replica): self._redispatch_seeds(rnd, [sr], "same_worker")
                )
        if done and done == n_seeds:
            self.metrics.round_latency.observe(max(0.0, time.time() - float(created)))
        return followups

    # ---- spot checks ----------------------------------------------------------------------------------
    def _resolve(self, rnd: ProbeRound, seed: int) -> None:
        s, run, rid = self.store, rnd.run, rnd.round_id
        _, _, _, rtol, atol = self._round(run, rid)
        vals = s.r.hmget(s.keys.k_round(run, rid, "spot"), [f"{seed}:{r}" for r in range(3)])
        r0, r1, r2 = (None if v is None else ProbeResult.model_validate_json(v) for v in vals)
        dec = s.keys.k_round(run, rid, "dec")
        if r0 is None or r1 is None:
            return
        if r2 is None:
            if values_agree(r0, r1, rtol, atol):
                if s.r.hsetnx(dec, str(seed), "agree"):
                    self.metrics.spot_checks.labels("agree").inc()
                    self._publish_value(rnd, r0, verified=True)
            elif s.r.hsetnx(dec, f"{seed}:pair", "disagree"):
                self.metrics.spot_checks.labels("disagree").inc()
                self._send(rnd, [seed], 2, "spot_check_third")
            return
        if not s.r.hsetnx(dec, str(seed), "final"):
            return
        a02, a12 = values_agree(r0, r2, rtol, atol), values_agree(r1, r2, rtol, atol)
        if a02 and a12:
            self.metrics.spot_checks.labels("resolved").inc()
            self._publish_value(rnd, r0, verified=True)
        elif a02 or a12:
            good, bad = (r0, r1) if a02 else (r1, r0)
            self.metrics.spot_checks.labels("resolved").inc()
            self._publish_value(rnd, good, verified=True)
            self.quarantine(bad.worker_id, run)
        else:
            self.metrics.spot_checks.labels("unresolved").inc()
            event = StreamEvent(kind="dropped", run=run, round_id=rid, seed=seed)
            s.r.xadd(self.stream_key(run), {"e": event.model_dump_json()})

    def _publish_value(self, rnd: ProbeRound, res: ProbeResult, verified: bool) -> None:
        s, run, rid = self.store, rnd.run, rnd.round_id
        event = StreamEvent(
            kind="accepted", run=run, round_id=rid, seed=res.seed, result=res, verified=verified
        )
        keys = [s.keys.k_round(run, rid), s.keys.k_round(run, rid, "acc"), self.stream_key(run)]
        done = int(self._publish(keys=keys, args=[res.seed, event.model_dump_json()]))
        if done >= 0:
            self.metrics.result_age.observe(max(0, s.runs.latest_version(run) - rnd.version))
            h = s.r.hmget(s.keys.k_round(run, rid), ["n_seeds", "created_at"])
            if done == int(h[0]):
                self.metrics.round_latency.observe(max(0.0, time.time() - float(h[1])))

    def _redispatch_seeds(self, rnd: ProbeRound, seed_replicas: list[tuple[int, int]], reason: str) -> None:
        """Re-send seeds whose evaluation was refused, at most `max_redispatch` times per (seed, replica)."""
        s = self.store
        if s.r.hget(s.keys.k_round(rnd.run, rnd.round_id), "state") != "open":
            return
        key = s.keys.k_round(rnd.run, rnd.round_id, "redispatch")
        by_replica: dict[int, list[int]] = {}
        for seed, replica in seed_replicas:
            if replica > 0 and not s.spot_copy_placeable(rnd.run, rnd.round_id, seed):
                self.drop_spot_copy(rnd, seed)  # no other worker to take it: re-sending would only loop
            elif s.r.hincrby(key, f"{seed}:{replica}", 1) <= s.settings.max_redispatch:
                by_replica.setdefault(replica, []).append(seed)
            elif replica > 0:
                self._give_up(rnd, seed)
            elif reason == "non_finite":
                self._drop(rnd, seed)
        for replica, seeds in by_replica.items():
            self._send(rnd, seeds, replica, reason)

    def drop_spot_copy(self, rnd: ProbeRound, seed: int) -> None:
        """A spot-check copy of `seed` that no live worker but those holding its other replicas could take: given up
        now (`_give_up`: the held value streams unverified), counted in `sparecycles_spot_copies_dropped_total{reason=
        "no_other_worker"}`, instead of being re-sent to a worker intake refuses again (`same_worker`)."""
        if self._give_up(rnd, seed):
            self.metrics.spot_copies_dropped.labels("no_other_worker").inc()

    def _give_up(self, rnd: ProbeRound, seed: int) -> bool:
        # No distinct worker could be found for a replica. Values of quarantined workers are set aside (their
        # worker was outvoted, e.g. on another seed): the seed's honest value must not be lost with them. One
        # value left (or values that agree) is streamed unverified (no evidence against it); values that
        # still disagree are dropped: either may be the liar's.
        # Returns whether this call decided the seed (False: decided before).
        s = self.store
        if not s.r.hsetnx(s.keys.k_round(rnd.run, rnd.round_id, "dec"), str(seed), "skipped"):
            return False
        values = self._unquarantined_values(rnd, seed)
        spec = s.runs.run_spec(rnd.run)
        agree = all(values_agree(values[0], v, spec.spot_rtol, spec.spot_atol) for v in values[1:])
        if values and agree:
            self.metrics.spot_checks.labels("skipped").inc()
            self._publish_value(rnd, values[0], verified=False)
            return True
        self.metrics.spot_checks.labels("unresolved").inc()
        event = StreamEvent(kind="dropped", run=rnd.run, round_id=rnd.round_id, seed=seed)
        s.r.xadd(self.stream_key(rnd.run), {"e": event.model_dump_json()})
        return True

    def _unquarantined_values(self, rnd: ProbeRound, seed: int) -> list[ProbeResult]:
        """The held replicas of a spot-checked `seed` (replica order) whose worker is not quarantined (a
        deleted worker's record is gone: its value is kept, there is no evidence against it)."""
        s = self.store
        stored = s.r.hmget(s.keys.k_round(rnd.run, rnd.round_id, "spot"), [f"{seed}:{r}" for r in range(3)])
        values = [ProbeResult.model_validate_json(v) for v in stored if v is not None]
        pipe = s.r.pipeline(transaction=False)
        for v in values:
            pipe.hget(s.keys.k_worker(v.worker_id), "state")
        return [v for v, state in zip(values, pipe.execute(), strict=True) if state != "quarantined"]

    def _drop(self, rnd: ProbeRound, seed: int) -> None:
        # Every evaluation of the seed was non-finite: the round is told (a `dropped` event, once) rather
        # than left waiting for a value that will not come.
        s = self.store
        if s.r.hexists(s.keys.k_round(rnd.run, rnd.round_id, "acc"), str(seed)):
            return
        if s.r.hsetnx(s.keys.k_round(rnd.run, rnd.round_id, "dec"), str(seed), "non_finite"):
            event = StreamEvent(kind="dropped", run=rnd.run, round_id=rnd.round_id, seed=seed)
            s.r.xadd(self.stream_key(rnd.run), {"e": event.model_dump_json()})

    def _send(self, rnd: ProbeRound, seeds: list[int], replica: int, reason: str) -> None:
        sent = self.store.dispatch.publish_tasks(rnd.run, self.store.dispatch.tasks_for(rnd, seeds, replica))
        self.metrics.redispatched.labels(reason).inc(sent)
        self.metrics.tasks_published.inc(sent)

    # ---- quarantine -------------------------------------------------------------------------------------
    def quarantine(self, wid: str, run: str) -> None:
        """Quarantine a worker; retract its unverified accepted results in `run`'s open rounds and re-send them."""
        s = self.store
        try:
            s.workers.set_worker_state(wid, "quarantined", ("active", "draining", "lost"), actor="coordinator")
        except (NotFound, Conflict):  # unknown, or quarantined already
            return
        self.metrics.quarantined.inc()
        for rid in s.r.smembers(s.keys.k_run(run, "rounds:open")):
            rnd, spot = self._round(run, rid)[:2]
            keys = [s.keys.k_round(run, rid), s.keys.k_round(run, rid, "acc"), self.stream_key(run)]
            seeds = []
            for seed, body in s.r.hgetall(s.keys.k_round(run, rid, "acc")).items():
                ev = json.loads(body)
                if ev["verified"] or int(seed) in spot or ev["result"]["worker_id"] != wid:
                    continue
                retraction = StreamEvent(kind="retracted", run=run, round_id=rid, seed=int(seed))
                if self._retract(keys=keys, args=[seed, body, retraction.model_dump_json()]):
                    seeds.append(int(seed))
            if seeds:
                self.metrics.retracted.inc(len(seeds))
                self._send(rnd, seeds, 0, "retracted")

    def attest(self, run: str, wid: str, digest: str) -> bool:
        """Record a worker's canary digest for `run`; True if it matches the run's canary (or none is set)."""
        spec = self.store.runs.run_spec(run)
        if spec.canary is None or spec.canary.digest == digest:
            self.store.r.sadd(self.store.keys.k_run(run, "attested"), wid)
            return True
        return False
