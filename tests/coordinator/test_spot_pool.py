"""Spot checks that adapt to the pool: a second replica needs a second live worker. Real Redis, a real uvicorn
server, results posted over HTTP. With one live worker a round opens without spot-check copies; a copy whose first
replica the only live worker holds is given up (its value streamed unverified), not re-sent: each counted in
`sparecycles_spot_copies_dropped_total`. Before, such a copy went back to the queue up to `max_redispatch` times per
seed (a one-worker run re-issued 201 of them), each evaluation of it wasted."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.deadlines import RoundWatch
from coordinator.intake import Intake
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import Store
from coordinator.stream import ResultStreamReader
from support.coordinator import Env, open_spot_round, result, running_env

RUN, RID = "p", "r0"


@pytest.fixture
def env(tmp_path):
    # explicit RoundWatch ticks decide here, not the app's reaper
    yield from running_env(tmp_path, reaper_interval_s=3600.0)


def _metric(env: Env, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(env.admin.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not exported")


def _events(env: Env) -> list[tuple[str, int, bool | None]]:
    reader = ResultStreamReader(env.settings.redis_url, RUN, key_prefix=env.settings.key_prefix)
    try:
        return [(e.kind, e.seed, e.verified) for _, e in reader.read(count=100, block_ms=10)]
    finally:
        reader.r.close()


def _replicas(env: Env) -> list[tuple[list[int], int]]:
    return [(t["kwargs"]["seeds"], t["kwargs"]["replica"]) for t in env.queue_messages(RUN)]


def _post(client, res: dict) -> list[str]:
    reply = client.post(f"/v1/runs/{RUN}/results", json={"results": [res]})
    assert reply.status_code == 200, reply.text
    return reply.json()["outcomes"]


def test_a_round_opened_with_one_live_worker_has_no_spot_copies(env: Env):
    """One worker enrolled: the round's seeds go out once each, plain; the worker's values are accepted at once
    (not held for a twin that only it could evaluate), and the 3 copies not sent are counted."""
    reg, w = env.enroll("only")
    info = open_spot_round(env, RUN, RID, [1, 2, 3])
    assert info["n_spot_checks"] == 0 and _replicas(env) == [([1], 0), ([2], 0), ([3], 0)]
    assert _metric(env, "sparecycles_spot_copies_dropped_total", reason="one_worker_at_open") == 3
    assert [_post(w, result(RUN, RID, s, reg["worker_id"])) for s in (1, 2, 3)] == [["accepted"]] * 3
    assert _events(env) == [("accepted", 1, False), ("accepted", 2, False), ("accepted", 3, False)]


def test_no_live_worker_at_opening_keeps_the_copies_waiting(env: Env):
    """No worker yet (the pool is not there): the copies are sent and wait in the queue, nothing counted."""
    info = open_spot_round(env, RUN, RID, [1, 2])
    assert info["n_spot_checks"] == 2 and sorted(r for _, r in _replicas(env)) == [0, 0, 1, 1]
    assert _metric(env, "sparecycles_spot_copies_dropped_total", reason="one_worker_at_open") == 0


def test_a_copy_only_its_first_evaluator_could_take_is_given_up_not_resent(env: Env):
    """Workers a and b at the opening; b leaves; a posts replica 0 (held) and then the copy (replica 1) itself:
    `same_worker`, and with no other live worker it is given up at once: a's value streamed unverified, no task
    re-sent, one copy counted. With b still live the copy goes back to the queue for b (re-sent once)."""
    (ra, a), (rb, b) = env.enroll("a"), env.enroll("b")
    open_spot_round(env, RUN, RID, [7, 8])
    queued = len(_replicas(env))
    assert queued == 4
    A = ra["worker_id"]
    assert _post(a, result(RUN, RID, 8, A)) == ["held"]
    assert _post(a, result(RUN, RID, 8, A, replica=1)) == ["same_worker"]  # b is live: re-sent for b
    assert _replicas(env)[queued:] == [([8], 1)]
    assert env.admin.delete(f"/v1/workers/{rb['worker_id']}").status_code in (200, 204)
    assert _post(a, result(RUN, RID, 7, A)) == ["held"]
    assert _post(a, result(RUN, RID, 7, A, replica=1)) == ["same_worker"]
    assert len(_replicas(env)) == queued + 1  # nothing more re-sent
    assert _events(env) == [("accepted", 7, False)]
    assert _metric(env, "sparecycles_spot_copies_dropped_total", reason="no_other_worker") == 1
    assert _metric(env, "sparecycles_tasks_redispatched_total", reason="same_worker") == 1
    b.close()


def test_a_deadline_gives_up_a_copy_no_other_worker_could_take(env: Env):
    """A round's deadline passes (a lost lease) with seed 5's replica 0 held by a, the only live worker: the
    deadline re-issues seed 6's replicas (nobody holds either) and gives up seed 5's copy instead of re-sending it."""
    (ra, a), (rb, _) = env.enroll("a"), env.enroll("b")
    open_spot_round(env, RUN, RID, [5, 6])
    assert _post(a, result(RUN, RID, 5, ra["worker_id"])) == ["held"]
    assert env.admin.delete(f"/v1/workers/{rb['worker_id']}").status_code in (200, 204)
    store = Store(env.settings)
    metrics = CoordinatorMetrics()
    env.r.delete(env.settings.queue_prefix + "." + RUN)  # every task taken
    watch = RoundWatch(store, Intake(store, metrics).drop_spot_copy)
    watch.worker_lost()
    assert watch.tick() == [(RUN, RID, 2)]  # seed 6, replicas 0 and 1
    assert sorted(_replicas(env)) == [([6], 0), ([6], 1)]
    assert _events(env) == [("accepted", 5, False)]
    assert metrics.spot_copies_dropped.labels("no_other_worker")._value.get() == 1
