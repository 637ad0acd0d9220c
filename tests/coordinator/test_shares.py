"""Shares on a real coordinator (real Redis, uvicorn, HTTP; workers played over HTTP): the share's bounds at the
boundary, the heartbeat's queue answer by share, worker-seconds from results, a run's end freeing its share."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from support.coordinator import Env, result, round_body


def _metrics(env: Env) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(env.admin.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _refused(env: Env) -> float:
    return _metrics(env).get(("sparecycles_rejected_requests_total", (("reason", "validation"),)), 0.0)


def test_share_out_of_bounds_is_refused_and_counted(env: Env) -> None:
    before = _refused(env)
    bodies = [{"share": 0.0, "schema_version": 2}, {"share": -1.0, "schema_version": 2},
              {"share": 1001.0, "schema_version": 2}, {"share": 3.0}]  # the last: a share needs schema 2
    for extra in bodies:
        resp = env.admin.post("/v1/runs", json={"run": "x", "model_class": "GPT2LMHeadModel", **extra})
        assert resp.status_code == 422, (extra, resp.text)
    raw = b'{"run": "x", "model_class": "GPT2LMHeadModel", "schema_version": 2, "share": Infinity}'
    resp = env.admin.post("/v1/runs", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert _refused(env) - before == 5
    assert env.admin.get("/v1/runs/x").status_code == 404

    env.create_run("x", share=2.5, schema_version=2)
    assert env.admin.get("/v1/runs/x").json()["spec"]["share"] == 2.5
    env.create_run("y")  # default share 1: the spec carries no share, as a schema-1 one
    assert "share" not in env.admin.get("/v1/runs/y").json()["spec"]
    m = _metrics(env)
    assert m[("sparecycles_run_share", (("run", "x"),))] == 2.5
    assert m[("sparecycles_run_share", (("run", "y"),))] == 1.0


def _open_round(env: Env, run: str, rid: str, seeds: list[int]) -> None:
    batch = env.upload(run.encode() * 64)
    assert env.admin.post(f"/v1/runs/{run}/rounds", json=round_body(run, rid, batch, seeds)).status_code == 201


def test_heartbeats_follow_shares_and_an_ended_run_frees_its_share(env: Env) -> None:
    env.create_run("a", share=3.0, schema_version=2, spot_check_fraction=0.0, seeds_per_task=1)
    env.create_run("b", spot_check_fraction=0.0, seeds_per_task=1)
    for run in ("a", "b"):
        env.publish_version(run, 0, run.encode() * 8)
        _open_round(env, run, "r0", list(range(8)))  # 8 tasks wait in each queue (no worker takes them)
    workers = [env.enroll(f"w{i}") for i in range(4)]
    qa, qb = (f"{env.settings.queue_prefix}.{run}" for run in ("a", "b"))

    def beat(reg: dict, w) -> list[str]:
        resp = w.post(f"/v1/workers/{reg['worker_id']}/heartbeat", json={"busy": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["queues"]

    answers = [beat(reg, w) for reg, w in workers]
    assert sorted(map(tuple, answers)) == [(qa,), (qa,), (qa,), (qb,)]  # 4 workers at 3:1: three on a, one on b
    assert [beat(reg, w) for reg, w in workers] == answers  # steady: nobody switches

    # worker-seconds: each task's `task_s` is added to its run (counter and Redis), results of any outcome
    reg, w = workers[0]
    for seed, took in ((0, 1.5), (1, 2.25)):
        batch = {"schema_version": 2, "task_s": took, "results": [result("a", "r0", seed, reg["worker_id"])]}
        assert w.post("/v1/runs/a/results", json=batch).status_code == 200
    bad = {"schema_version": 2, "task_s": -1.0, "results": [result("a", "r0", 2, reg["worker_id"])]}
    assert w.post("/v1/runs/a/results", json=bad).status_code == 422
    m = _metrics(env)
    assert m[("sparecycles_run_worker_seconds_total", (("run", "a"),))] == 3.75
    assert ("sparecycles_run_worker_seconds_total", (("run", "b"),)) not in m
    assert float(env.r.hget(f"{env.settings.key_prefix}:{{a}}:run", "worker_s")) == 3.75

    # run a ends: at their next heartbeat every worker is on b, the only run with work
    assert env.admin.post("/v1/runs/a/end").status_code == 200
    assert [beat(reg, w) for reg, w in workers] == [[qb]] * 4
    # b's queue emptied: every worker consumes every run's queue (work-conserving: none waits for an answer)
    env.r.delete(qb)
    assert [beat(reg, w) for reg, w in workers] == [[qb]] * 4
    env.create_run("c", spot_check_fraction=0.0)
    qc = f"{env.settings.queue_prefix}.c"
    assert beat(*workers[0]) == [qb, qc]


def test_a_new_run_starts_level_with_the_least_served(env: Env) -> None:
    env.create_run("a", spot_check_fraction=0.0)
    reg, w = env.enroll("w0")
    batch = {"schema_version": 2, "task_s": 40.0, "results": [result("a", "r0", 0, reg["worker_id"])]}
    w.post("/v1/runs/a/results", json=batch)  # the round is unknown (refused), the time still counts
    env.create_run("b", share=2.0, schema_version=2, spot_check_fraction=0.0)
    key = f"{env.settings.key_prefix}:{{b}}:run"
    assert float(env.r.hget(key, "vt_base")) == 40.0  # a's virtual time 40 / 1: b owes nothing and is owed nothing
    assert json.loads(env.r.hget(key, "spec"))["share"] == 2.0


def test_a_run_held_to_one_worker_gives_up_its_spot_copies(env: Env) -> None:
    """Two workers, two runs with work at 1:1: one worker each. Run x's spot copy comes back from x's only worker
    (`same_worker`): with no other worker told to consume x it is given up and counted, not re-sent."""
    env.create_run("x", spot_check_fraction=1.0, spot_rtol=1e-6, spot_atol=0.0, seeds_per_task=1)
    env.create_run("y", spot_check_fraction=0.0, seeds_per_task=1)
    for run in ("x", "y"):
        env.publish_version(run, 0, run.encode() * 8)
    workers = [env.enroll(f"w{i}") for i in range(2)]  # enrolled before the rounds: x's copies are sent
    for run in ("x", "y"):
        _open_round(env, run, "r0", [1, 2, 3])
    told = {}
    for reg, w in workers:
        told[reg["worker_id"]] = w.post(f"/v1/workers/{reg['worker_id']}/heartbeat", json={}).json()["queues"]
    qx = f"{env.settings.queue_prefix}.x"
    on_x = [wid for wid, queues in told.items() if queues == [qx]]
    assert len(on_x) == 1
    client = dict((reg["worker_id"], w) for reg, w in workers)[on_x[0]]
    sent = len(env.queue_messages("x"))
    post = lambda res: client.post("/v1/runs/x/results", json={"results": [res]}).json()["outcomes"]  # noqa: E731
    assert post(result("x", "r0", 1, on_x[0])) == ["held"]
    assert post(result("x", "r0", 1, on_x[0], replica=1)) == ["same_worker"]
    assert len(env.queue_messages("x")) == sent  # not re-sent
    m = _metrics(env)
    assert m[("sparecycles_spot_copies_dropped_total", (("reason", "no_other_worker"),))] == 1


def test_a_worker_client_falls_back_to_schema_1_on_a_coordinator_without_task_time(env: Env, monkeypatch) -> None:
    """A coordinator older than shares refuses a result batch with `task_s` (422, unknown field): the worker's client
    sends it again without, and every later batch too (played here by a route refusing what schema 1 forbids)."""
    from coordinator.client import CoordinatorClient, CoordinatorHTTPError
    from wire.round_messages import ProbeResult, ResultBatch

    env.create_run("q", spot_check_fraction=0.0)
    env.publish_version("q", 0, b"w")
    _open_round(env, "q", "r0", [1, 2])
    reg, _ = env.enroll("old")
    client = CoordinatorClient(env.url, reg["worker_token"])
    real = client.request
    sent = []

    def old_coordinator(method, path, **kw):
        sent.append(json.loads(kw["content"]))
        if "task_s" in sent[-1]:
            raise CoordinatorHTTPError(method, path, 422, '{"detail": [{"loc": ["body", "task_s"], "msg": "Extra '
                                       'inputs are not permitted"}]}')
        return real(method, path, **kw)

    monkeypatch.setattr(client, "request", old_coordinator)
    try:
        for seed in (1, 2):
            res = ProbeResult(run="q", round_id="r0", seed=seed, version=0, worker_id=reg["worker_id"], l_plus=1.0,
                              l_minus=2.0)
            assert client.post_results("q", ResultBatch(results=[res], task_s=0.5, schema_version=2)).outcomes == [
                "accepted"]
    finally:
        client.close()
    assert ["task_s" in body for body in sent] == [True, False, False]  # refused once, then schema 1 only
    assert client.results_schema == 1


def test_a_drained_worker_counts_on_no_run(env: Env) -> None:
    """An admin drains one of two workers: it takes no task, so the other one is told the run with work, and the
    drained one every queue (its heartbeat's state says draining)."""
    env.create_run("a", spot_check_fraction=0.0, seeds_per_task=1)
    env.create_run("b", spot_check_fraction=0.0, seeds_per_task=1)
    env.publish_version("a", 0, b"a" * 8)
    _open_round(env, "a", "r0", [1, 2, 3])
    (r0, w0), (r1, w1) = env.enroll("w0"), env.enroll("w1")
    qa, qb = (f"{env.settings.queue_prefix}.{run}" for run in ("a", "b"))
    assert env.admin.post(f"/v1/workers/{r0['worker_id']}/drain").status_code == 200
    hb0 = w0.post(f"/v1/workers/{r0['worker_id']}/heartbeat", json={}).json()
    hb1 = w1.post(f"/v1/workers/{r1['worker_id']}/heartbeat", json={}).json()
    assert (hb0["state"], hb0["queues"]) == ("draining", [qa, qb])
    assert hb1["queues"] == [qa]
    assert set(env.r.hgetall(f"{env.settings.key_prefix}:share_assign")) == {r1["worker_id"]}


def test_a_worker_yielding_to_its_engine_counts_on_no_run(env: Env) -> None:
    """A worker beside a serving engine whose yielded seconds grew since its last heartbeat is yielding: it takes
    no task, so it is counted on no run (told every queue) until its yielded seconds stop growing."""
    env.create_run("a", spot_check_fraction=0.0, seeds_per_task=1)
    env.publish_version("a", 0, b"a" * 8)
    _open_round(env, "a", "r0", [1, 2, 3])
    reg, w = env.enroll("beside-engine")
    qa = f"{env.settings.queue_prefix}.a"
    assign = f"{env.settings.key_prefix}:share_assign"

    def beat(yielded_s: float) -> list[str]:
        serving = {"yielded_s": yielded_s, "engine_idle_s": 0.0, "idle_used_s": 0.0}
        resp = w.post(f"/v1/workers/{reg['worker_id']}/heartbeat", json={"serving": serving})
        assert resp.status_code == 200, resp.text
        return resp.json()["queues"]

    assert beat(0.0) == [qa] and reg["worker_id"] in env.r.hgetall(assign)  # first figures: taking tasks
    assert beat(2.5) == [qa] and reg["worker_id"] not in env.r.hgetall(assign)  # yielded 2.5 s since: on no run
    assert beat(2.5) == [qa] and reg["worker_id"] in env.r.hgetall(assign)  # the yield is over: on run a again
