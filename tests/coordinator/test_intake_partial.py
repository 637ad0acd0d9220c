"""Issue 14 case 4: a results batch is judged per result.

Real coordinator (uvicorn in a thread) on the shared Redis: one NaN and one malformed entry among 8 cost
only themselves (6 accepted, each outcome counted); the worker's own client reports a non-finite loss
as such; the seed is re-issued on the queue, and past `max_redispatch` the round is told (`dropped`).
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import CoordinatorClient
from coordinator.stream import ResultStreamReader
from support.coordinator import Env, result, running_env
from wire.round_messages import ProbeResult, ResultBatch, non_finite_result


def metric_samples(env: Env) -> dict[tuple[str, tuple], float]:
    """Every sample of the coordinator's /metrics, keyed by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(env.admin.get("/metrics").text)
        for s in fam.samples
    }


@pytest.fixture
def env(tmp_path):
    yield from running_env(tmp_path, max_redispatch=1)


def _open_round(env: Env, run: str, seeds: list[int]) -> None:
    env.create_run(run, spot_check_fraction=0.0, seeds_per_task=8)
    env.publish_version(run, 0, b"v0")
    rnd = {
        "run": run,
        "round_id": "r0",
        "version": 0,
        "batch_sha256": env.upload(b"batch"),
        "eps": 1e-3,
        "distribution": "rademacher",
        "seeds": seeds,
    }
    assert env.admin.post(f"/v1/runs/{run}/rounds", json=rnd).status_code == 201


def test_one_bad_entry_costs_only_itself(env: Env):
    _open_round(env, "p", list(range(1, 9)))
    reg, w = env.enroll("gpu0")
    wid = reg["worker_id"]
    entries = [json.dumps(result("p", "r0", s, wid, lp=float(s), lm=-float(s))) for s in range(1, 9)]
    entries[2] = entries[2].replace('"l_plus": 3.0', '"l_plus": NaN')  # seed 3: a NaN loss
    entries[5] = entries[5].replace('"seed": 6', '"seed": "6"')  # seed 6: not an integer
    body = '{"results": [' + ",".join(entries) + "]}"
    resp = w.post("/v1/runs/p/results", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    want = ["accepted"] * 8
    want[2], want[5] = "non_finite", "malformed"
    assert resp.json()["outcomes"] == want
    assert env.admin.get("/v1/runs/p/rounds/r0").json()["done"] == 6
    m = metric_samples(env)
    for outcome, n in (("accepted", 6), ("non_finite", 1), ("malformed", 1)):
        assert m[("sparecycles_intake_results_total", (("outcome", outcome),))] == n, outcome
    assert env.admin.get(f"/v1/workers/{wid}").json()["rejected"] == 2
    # seed 3 was re-issued (one task of the round, then one re-dispatch of [3]); seed 6's entry has no
    # trustworthy identity, so nothing is re-issued for it
    tasks = env.queue_messages("p")
    assert [t["kwargs"]["seeds"] for t in tasks] == [list(range(1, 9)), [3]]
    assert m[("sparecycles_tasks_redispatched_total", (("reason", "non_finite"),))] == 1
    events = ResultStreamReader(env.settings.redis_url, "p", key_prefix=env.settings.key_prefix).read(
        count=100, block_ms=10
    )
    assert [(e.kind, e.seed) for _, e in events] == [("accepted", s) for s in (1, 2, 4, 5, 7, 8)]


def test_worker_client_reports_non_finite_and_the_round_is_told(env: Env):
    _open_round(env, "q", [10, 11])
    reg, _ = env.enroll("gpu1")
    wid = reg["worker_id"]
    fields = {"run": "q", "round_id": "r0", "seed": 10, "version": 0, "worker_id": wid}
    client = CoordinatorClient(env.url, reg["worker_token"])
    try:
        batch = ResultBatch(
            results=[
                non_finite_result(**fields, l_plus=float("inf"), l_minus=1.0),
                ProbeResult(**{**fields, "seed": 11}, l_plus=1.0, l_minus=2.0),
            ]
        )
        assert client.post_results("q", batch).outcomes == ["non_finite", "accepted"]
        # max_redispatch=1: the second non-finite report of seed 10 is past the bound -> `dropped`
        again = ResultBatch(results=[non_finite_result(**fields, l_plus=float("nan"), l_minus=float("nan"))])
        assert client.post_results("q", again).outcomes == ["non_finite"]
    finally:
        client.close()
    assert [t["kwargs"]["seeds"] for t in env.queue_messages("q")] == [[10, 11], [10]]
    events = ResultStreamReader(env.settings.redis_url, "q", key_prefix=env.settings.key_prefix).read(
        count=100, block_ms=10
    )
    assert [(e.kind, e.seed) for _, e in events] == [("accepted", 11), ("dropped", 10)]
