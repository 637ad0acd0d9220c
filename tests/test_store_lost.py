"""A coordinator whose Redis comes back empty (restart without persistence, failover to a fresh replica, a flush):
real Redis, a real coordinator process and real probe-worker processes (support.fleet.Fleet); the store is lost by
deleting every key of the fleet's prefix mid-run (what a FLUSHALL does to this fleet, without touching the other
tests sharing the server).

Workers re-enroll with their enrollment token (a new id, counted, one log line per state change); the trainer
re-creates its run, re-publishes its current version and re-issues the rounds in flight (fleet.recovery).
"""

from __future__ import annotations

import pytest

from support.fleet import make_batch
from support.models import tiny_gpt2
from trainer.zo.probes import RoundSpec

pytestmark = pytest.mark.slow  # a coordinator process and probe-worker processes


def lose_store(fleet) -> int:
    """Delete every Redis key of `fleet` (registry, runs, rounds, streams, queues, kombu bindings); returns how
    many. The coordinator process keeps running on the now empty store."""
    keys = [k for pattern in (f"{fleet.prefix}*", f"_kombu.binding*.{fleet.prefix}*")
            for k in fleet.r.scan_iter(pattern, count=1000)]
    if keys:
        fleet.r.delete(*keys)
    return len(keys)


def test_workers_reenroll_after_the_store_is_lost(fleet):
    """Both workers notice at their next heartbeat, re-enroll under new ids (sparecycles_worker_reenrollments_total
    1 each), log the loss once (not twice a second) and evaluate the next run's rounds."""
    old = {name: fleet.wait_consuming(name) for name in ("a", "b")}
    assert lose_store(fleet) > 0
    fleet.wait(lambda: all((fleet.worker_info(n) or {}).get("worker_id") not in (None, old[n]) for n in old),
               "both workers re-enrolled")
    new = {name: fleet.wait_consuming(name) for name in old}
    assert set(new.values()).isdisjoint(old.values())
    for name in old:
        assert fleet.metric(name, "sparecycles_worker_reenrollments_total") == 1.0
        log = (fleet.tmp / f"{name}.log").read_text()
        assert log.count("coordinator no longer knows this worker") == 1, log[-3000:]
        assert log.count(f"re-enrolled as {new[name]} (was {old[name]})") == 1, log[-3000:]

    model = tiny_gpt2()
    be = fleet.backend(model, "after-loss")
    be.publish(0)
    seeds = tuple(range(10, 18))
    be.submit(RoundSpec("after-0", 0, make_batch(2, 8, seed=3), eps=1e-2, seeds=seeds, distribution="rademacher"))
    got = be.collect("after-0").results
    assert sorted(r.seed for r in got) == list(seeds)
    assert {r.worker for r in got} <= set(new.values())
    be.close()
