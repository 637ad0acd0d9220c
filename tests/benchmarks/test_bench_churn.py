"""`sparecycles bench churn` (benchmarks.churn) on a short schedule: a `--fleet-wait sync` trainer on a local fleet of
3 CPU workers while, every 3 s, a seeded event kills, terminates, stops past its lease or adds a worker. The
invariants hold whatever the timing: no round lost, no result counted twice, and the losses equal the in-process
run's bit for bit. The event chooser is also checked alone (the pool stays between 1 and N live workers)."""

from __future__ import annotations

import json
import random
import signal

import pytest

from benchmarks.churn import ChurnOptions, Pool, choose, run_churn_bench, with_replacement
from benchmarks.churn_redis import OwnRedis
from benchmarks.churn_report import add_counts


def test_the_schedule_keeps_one_to_n_live_workers():
    """A removal strikes a ready worker and leaves one: with one ready it becomes a join (a worker still starting
    does not count); a join with N started and not removed (stopped ones count) becomes a removal, or nothing."""
    rng, kinds = random.Random(0), ("kill", "term", "stop", "join")
    pool = Pool(live=["w0", "w1"])
    assert {choose(rng, ("kill", "term", "stop"), pool, 4, {"w0"}) for _ in range(20)} == {"none"}
    assert {choose(rng, ("kill", "join"), pool, 4, {"w0"}) for _ in range(20)} == {"join"}
    pool = Pool(live=["w0", "w1", "w2"], stopped={"w3": (0.0, signal.SIGCONT)})
    ready = {"w0", "w1", "w2"}
    assert {choose(rng, ("join",), pool, 4, ready) for _ in range(5)} == {"none"}
    assert {choose(rng, ("join", "kill"), pool, 4, ready) for _ in range(20)} == {"kill"}
    assert len({choose(rng, kinds, Pool(live=["a", "b", "c"]), 4, {"a", "b", "c"}) for _ in range(60)}) == 4
    # a yield is a removal (the worker takes no task until SIGUSR2); a coordinator restart is always possible
    assert {choose(rng, ("yield", "restart"), Pool(live=["a"]), 4, {"a"}) for _ in range(40)} == {"none", "restart"}
    assert {choose(rng, ("redis",), Pool(live=["a"]), 4, set()) for _ in range(3)} == {"redis"}
    assert {choose(rng, ("yield",), Pool(live=["a", "b"]), 4, {"a", "b"}) for _ in range(5)} == {"yield"}
    draws = [choose(random.Random(7), kinds, Pool(live=["a", "b"]), 4, {"a", "b"}) for _ in range(3)]
    assert len(set(draws)) == 1  # seeded: the same schedule every time


def test_a_replacing_schedule_keeps_the_pool_at_n():
    """With `replace`, a kill or term is followed at once by its replacement's join, and a full pool draws no other
    join: played out over 200 events (a stop comes back before the next), N processes after every event; without
    it the same draw lets the pool fall to one."""
    from benchmarks.churn_report import mean_active

    kinds = ("kill", "term", "stop", "join")
    assert choose(random.Random(0), kinds, Pool(live=["a", "b", "c"]), 4, {"a", "b", "c"}, True) == "join"
    full = Pool(live=["a", "b", "c"], stopped={"d": (0.0, signal.SIGCONT)})
    assert "join" not in {choose(random.Random(i), kinds, full, 4, {"a", "b", "c"}, True) for i in range(40)}

    assert with_replacement("kill", True) == ("kill", "join")
    assert with_replacement("term", True) == ("term", "join") and with_replacement("stop", True) == ("stop",)
    assert with_replacement("kill", False) == ("kill",) and with_replacement("yield", True) == ("yield",)

    def play(replace: bool) -> list[int]:
        rng, pool, sizes = random.Random(3), Pool(live=["w0", "w1", "w2", "w3"], started=4), []
        for _ in range(200):  # a stopped worker is back before the next event (stop_s < the event period)
            for ev in with_replacement(choose(rng, kinds, pool, 4, set(pool.live), replace), replace):
                if ev == "join":
                    pool.live.append(f"w{pool.started}")
                    pool.started += 1
                elif ev in ("kill", "term"):
                    pool.live.remove(rng.choice(pool.live))
            sizes.append(len(pool.live))
        return sizes

    assert min(play(True)) == 4 and min(play(False)) == 1  # replaced at once: 4 processes after every event
    assert mean_active([{"t": 0.0, "active": ["a"] * 4}, {"t": 3.0, "active": ["a"] * 2},
                        {"t": 4.0, "active": []}]) == 3.5  # 4 workers for 3 s, 2 for 1 s
    assert mean_active([{"t": 0.0, "active": []}]) is None


def test_counters_read_before_a_coordinator_restart_are_added():
    before = {"sparecycles_tasks_redispatched_total": {"deadline": 3.0}, "x_total": {"": 1.0}}
    after = {"sparecycles_tasks_redispatched_total": {"deadline": 2.0, "same_worker": 1.0}}
    assert add_counts(before, after) == {"sparecycles_tasks_redispatched_total": {"deadline": 5.0, "same_worker": 1.0},
                                         "x_total": {"": 1.0}}
    assert before["sparecycles_tasks_redispatched_total"] == {"deadline": 3.0}  # the inputs are left as they were


def test_the_benchs_own_redis_keeps_its_data_across_a_restart(tmp_path):
    """The `redis` event's Redis: what was written before SHUTDOWN (queued tasks, unacked hashes, the coordinator's
    keys) is there after the restart, from the append-only file; a client reconnects by itself."""
    import redis

    from api.server import free_port

    own = OwnRedis(tmp_path / "redis", free_port())
    try:
        r = redis.Redis.from_url(own.url)
        r.rpush("q", "t1", "t2")
        r.hset("unacked", "tag", "msg")
        own.restart()
        assert own.restarts == 1 and own.proc.poll() is None
        assert r.lrange("q", 0, -1) == [b"t1", b"t2"] and r.hgetall("unacked") == {b"tag": b"msg"}
        assert (tmp_path / "redis").is_dir() and any((tmp_path / "redis").rglob("*.aof*"))
    finally:
        own.stop()
    assert own.proc.poll() is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_churn_schedule_loses_nothing_and_doubles_nothing(tmp_path):
    o = ChurnOptions(workers=3, every_s=3.0, seed=1, waits=("sync",), baseline=False, steps=8, curvature_interval=2,
                     probes=4, out=tmp_path, work=tmp_path / "work")
    rep = run_churn_bench(o, print)  # on the shared Redis (REDIS_URL or 127.0.0.1:6379), its own key prefix
    (arm,) = rep["arms"]
    assert sum(arm["events"].values()) >= 2, arm  # the schedule struck while the trainer ran
    assert arm["rounds"] >= 2 and arm["rounds_lost"] == 0, arm
    assert arm["results_counted_twice"] == 0, arm
    assert arm["bit_equal_to_in_process"] is True, arm
    saved = json.loads((tmp_path / "churn.json").read_text())
    assert saved["arms"][0]["rounds_lost"] == 0 and (tmp_path / "churn.png").stat().st_size > 0
