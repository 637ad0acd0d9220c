"""A coordinator whose Redis comes back empty (restart without persistence, failover to a fresh replica, a flush):
real Redis, a real coordinator process and real probe-worker processes (support.fleet.Fleet); the store is lost by
deleting every key of the fleet's prefix mid-run (what a FLUSHALL does to this fleet, without touching the other
tests sharing the server).

Workers re-enroll with their enrollment token (a new id, counted, one log line per state change); the trainer
re-creates its run, re-publishes its current version and re-issues the rounds in flight (fleet.recovery).
"""

from __future__ import annotations

import pytest

from fleet.backend import CoordinatorBackend
from support.fleet import make_batch
from support.models import tiny_gpt2
from trainer.zo.probes import RoundSpec


def test_results_stream_reports_a_lost_group_and_reads_on(redis_url):
    """A results stream whose key is deleted under the reader (its group with it): the next read re-creates the group
    and raises StreamLost once; reads then go on from the new stream's start."""
    import secrets

    import redis

    from coordinator.keys import results_stream_key
    from coordinator.stream import ResultStreamReader, StreamLost

    prefix = "tl" + secrets.token_hex(4)
    reader = ResultStreamReader(redis_url, "run", key_prefix=prefix)
    r = redis.Redis.from_url(redis_url)
    try:
        assert reader.read(block_ms=0) == []
        r.delete(results_stream_key(prefix, "run"))
        with pytest.raises(StreamLost):
            reader.read(block_ms=0)
        assert reader.groups_recreated == 1 and reader.read(block_ms=0) == [] and reader.groups_recreated == 1
    finally:
        r.delete(results_stream_key(prefix, "run"))
        reader.r.close()
        r.close()


def lose_store(fleet) -> int:
    """Delete every Redis key of `fleet` (registry, runs, rounds, streams, queues, kombu bindings); returns how
    many. The coordinator process keeps running on the now empty store."""
    keys = [k for pattern in (f"{fleet.prefix}*", f"_kombu.binding*.{fleet.prefix}*")
            for k in fleet.r.scan_iter(pattern, count=1000)]
    if keys:
        fleet.r.delete(*keys)
    return len(keys)


@pytest.mark.slow  # a coordinator process and probe-worker processes
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


@pytest.mark.slow  # a coordinator process and probe-worker processes
@pytest.mark.skipif(not hasattr(CoordinatorBackend, "connect"),
                    reason="fleet.recovery hooks into issue 26's composed CoordinatorBackend (wired with it)")
@pytest.mark.xfail(reason="known gap: the fleet evaluation run (train-eval-*, issue 27) is not re-created after a store loss; only the probe run is (fleet/recovery.py)", strict=False)
def test_training_run_outlives_a_lost_store(fleet, tmp_path):
    """`sparecycles train --coordinator` (zocurv-line, --fleet-sync: each round awaited) whose coordinator loses its
    store mid-run, preferably while a round is in flight: the trainer creates its run again (logged, counted in
    every later step's `fleet_runs_recreated`), the workers re-enroll, and the run finishes all its steps."""
    import json
    import subprocess
    import sys
    import time

    from support.fleet import ROOT, _free_port

    for name in ("a", "b"):
        fleet.wait_consuming(name)
    before = {name: fleet.metric(name, "sparecycles_worker_reenrollments_total") for name in ("a", "b")}
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "sparecycles.cli", "train", "--coordinator", fleet.url, "--optimizer", "zocurv-line",
           "--preset", "demo", "--steps", "18", "--batch-size", "4", "--seq-len", "32", "--curvature-interval", "3",
           "--eval-every", "9", "--fleet-sync", "--no-export", "--no-progress", "--metrics-port", str(_free_port()),
           "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, env={**fleet.env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        def steps() -> int:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
            return max((json.loads(line)["step"] for line in lines), default=0)

        def round_open() -> bool:
            return any(fleet.r.scard(k) for k in fleet.r.scan_iter(f"{fleet.prefix}:*rounds:open", count=1000))

        fleet.wait(lambda: proc.poll() is None and steps() >= 4 or proc.poll() is not None, "step 4", 600)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        deadline = time.monotonic() + 30  # lose the store with a round in flight if one opens in time
        while not round_open() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert steps() < 18 and lose_store(fleet) > 0
        out = proc.communicate(timeout=600)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 19))
    assert [r for r in recs if "loss" in r][-1]["fleet_runs_recreated"] == 1.0
    assert out.count("the coordinator lost run") == 1, out[-3000:]
    fleet.wait(lambda: all(fleet.metric(n, "sparecycles_worker_reenrollments_total") == before[n] + 1
                           for n in before), "both workers re-enrolled once more")


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_worker_with_its_own_broker_user_restarts_into_its_new_identity(tmp_path):
    """With per-worker broker users (SPARECYCLES_BROKER_ACL) a Valkey restarted empty (its files deleted) forgets the
    worker and its broker user: the worker re-enrolls, restarts its own process with the new broker credentials
    (same pid, the count carried over) and evaluates the next run's rounds."""
    import shutil
    import time

    from support.fleet import Fleet
    from support.valkey import Valkey

    v = Valkey(tmp_path / "valkey")
    v.start()

    class AclFleet(Fleet):
        def start_coordinator(self) -> None:
            self.env.update(SPARECYCLES_REDIS_URL=v.url, SPARECYCLES_BROKER_ACL="1")
            super().start_coordinator()

    fleet = AclFleet(tmp_path)
    try:
        proc = fleet.start_worker("a")
        old = fleet.wait_consuming("a")
        v.stop()
        shutil.rmtree(v.data)
        v.data.mkdir()
        v.start()  # empty: no state, no broker users
        deadline = time.monotonic() + 120
        while (fleet.worker_info("a") or {}).get("worker_id") in (None, old):
            assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.2)
        new = fleet.wait_consuming("a")
        assert proc.poll() is None  # the same process (exec), still running
        log = (tmp_path / "a.log").read_text()
        assert "with new broker credentials; restarting the worker process" in log
        fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_reenrollments_total") == 1.0, "the count carried over")

        from coordinator.messages import RunSpec

        model = tiny_gpt2()
        connect = getattr(CoordinatorBackend, "connect", CoordinatorBackend)  # issue 26 composes the backend
        be = connect(model, coordinator_url=fleet.url, admin_token=fleet.admin_token,
                                        redis_url=v.url, key_prefix=fleet.prefix, round_timeout_s=120.0,
                                        run=RunSpec(run="acl-after", model_class=type(model).__name__,
                                                    spot_check_fraction=0.0, seeds_per_task=2))
        be.publish(0)
        seeds = tuple(range(30, 34))
        be.submit(RoundSpec("acl-after-0", 0, make_batch(2, 8, seed=4), eps=1e-2, seeds=seeds,
                            distribution="rademacher"))
        got = be.collect("acl-after-0").results
        assert sorted(r.seed for r in got) == list(seeds) and {r.worker for r in got} == {new}
        be.close()
    finally:
        fleet.close()
        v.stop()
