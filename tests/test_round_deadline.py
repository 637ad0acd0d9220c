"""Issue 14 case 3: a stopped worker no longer stalls a round.

`test_quiet_round_is_reissued` drives `RoundWatch` with explicit times against the shared Redis (no
workers: the queue is emptied by hand, as a worker taking the tasks would). `test_paused_worker` is the
field case end to end: a coordinator process, two worker processes, one SIGSTOPped mid-round.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_coordinator_fixtures import Env, result, running_env

from coordinator.deadlines import RoundWatch, quantile
from coordinator.store import Store


def test_quantile_is_linear_interpolation():
    assert quantile([3.0], 0.9) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([4.0, 1.0, 2.0, 3.0], 0.9) == pytest.approx(3.7)  # numpy.quantile(..., 0.9)
    with pytest.raises(ValueError):
        quantile([], 0.5)


@pytest.fixture
def env(tmp_path):
    # the app's own reaper would tick with real time: slow it down so this test's explicit ticks decide
    yield from running_env(tmp_path, reaper_interval_s=3600.0, speculate_min_s=1.0, speculate_max=2)


def _gauge(env: Env, name: str, run: str) -> float:
    for fam in text_string_to_metric_families(env.admin.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels.get("run") == run:
                return s.value
    raise AssertionError(name)


def test_quiet_round_is_reissued(env: Env):
    env.create_run("d", spot_check_fraction=0.0, seeds_per_task=2)
    env.publish_version("d", 0, b"v0")
    rnd = {
        "run": "d",
        "round_id": "r0",
        "version": 0,
        "batch_sha256": env.upload(b"b"),
        "eps": 1e-3,
        "distribution": "rademacher",
        "seeds": [1, 2, 3, 4, 5, 6],
    }
    assert env.admin.post("/v1/runs/d/rounds", json=rnd).status_code == 201
    store = Store(env.settings)
    watch = RoundWatch(store)
    t0 = float(env.r.hget(store.k_round("d", "r0"), "created_at"))  # progress is timed from here
    assert watch.tick(t0) == [] and watch.deadline("d") == env.settings.speculate_initial_s
    queue = env.settings.queue_prefix + ".d"
    assert env.r.llen(queue) == 3 and _gauge(env, "sparecycles_outstanding_seeds", "d") == 6
    env.r.delete(queue)  # every task taken by a worker...
    reg, w = env.enroll("w")
    out = w.post(
        "/v1/runs/d/results", json={"results": [result("d", "r0", s, reg["worker_id"]) for s in (1, 2, 3, 4)]}
    )
    assert out.json()["outcomes"] == ["accepted"] * 4
    # progress after 0.5 s: one gap of 0.5 s -> deadline max(1.0, 3 x 0.5) = 1.5 s
    assert watch.tick(t0 + 0.5) == [] and watch.deadline("d") == pytest.approx(1.5)
    # ...and the worker holding seeds 5, 6 stopped: the queue is empty, outstanding is not (the old
    # queue-depth gauge read 0 here)
    assert _gauge(env, "sparecycles_queue_depth", "d") == 0
    assert _gauge(env, "sparecycles_outstanding_seeds", "d") == 2
    assert watch.tick(t0 + 1.9) == []  # 1.4 s quiet: within the deadline
    assert watch.tick(t0 + 2.1) == [("d", "r0", 1)]  # 1.6 s quiet: re-issued, seeds 5 and 6 only
    assert [m["kwargs"]["seeds"] for m in env.queue_messages("d")] == [[5, 6]]
    assert watch.tick(t0 + 2.2) == []  # the queue is not empty: an idle worker will take it
    env.r.delete(queue)
    assert watch.tick(t0 + 3.7) == [("d", "r0", 1)]  # deadline counted from the re-issue
    env.r.delete(queue)
    assert watch.tick(t0 + 9.0) == []  # speculate_max = 2 re-issues per round
    # first result wins: the stopped worker's late value is a duplicate of the re-issued one's
    late = [result("d", "r0", s, reg["worker_id"], lp=9.0) for s in (5, 6)]
    assert w.post("/v1/runs/d/results", json={"results": late}).json()["outcomes"] == ["accepted"] * 2
    assert w.post("/v1/runs/d/results", json={"results": late}).json()["outcomes"] == ["duplicate"] * 2
    assert _gauge(env, "sparecycles_outstanding_seeds", "d") == 0
