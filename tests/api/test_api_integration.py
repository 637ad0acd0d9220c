"""Integration tests: real Redis, a real uvicorn server, real HTTP, real Celery messages on Redis."""

from __future__ import annotations

import hashlib
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.store import spot_check_selected
from coordinator.stream import ResultStreamReader
from support.coordinator import Env, result, round_body, running_env
from wire.messages import WorkerRegistered


@pytest.fixture
def short_lease_env(tmp_path):
    yield from running_env(tmp_path, lease_seconds=1.0, heartbeat_interval_s=0.2)


def metric_samples(env: Env) -> dict[tuple[str, tuple], float]:
    text = env.admin.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_for(predicate, what: str, deadline_s: float = 120.0):
    """Poll until `predicate()` is truthy (a deadline guards against hangs; no timing is asserted)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_registration_heartbeat_lease_expiry_and_auth(short_lease_env: Env):
    env = short_lease_env
    reg, w = env.enroll("gpu0")
    WorkerRegistered.model_validate(reg)
    assert reg["broker_url"] == env.settings.redis_url and reg["lease_seconds"] == 1.0
    assert reg["probe_task_name"] == "sparecycles.probe"
    wid = reg["worker_id"]
    # tokens at rest: only the sha256 is stored, the raw token appears nowhere in Redis
    token = reg["worker_token"]
    for key in env.r.scan_iter(f"{env.settings.key_prefix}*"):
        if env.r.type(key) == "hash":
            assert token not in env.r.hvals(key)
    stored = env.r.hget(f"{env.settings.key_prefix}:w:{wid}", "token_sha256")
    assert stored == hashlib.sha256(token.encode()).hexdigest()

    before = time.time()
    hb = w.post(f"/v1/workers/{wid}/heartbeat", json={"busy": True, "version": 3})
    after = time.time()
    assert hb.status_code == 200 and hb.json()["state"] == "active"
    # the lease runs lease_seconds from the coordinator's reading of the heartbeat, which lies between this test's
    # two readings (one clock, one host): a slow machine widens the bracket, it cannot break it
    assert before + 1.0 <= hb.json()["lease"]["expires_at"] <= after + 1.0
    # auth: none / malformed / unknown -> 401; wrong role -> 403; another worker's id -> 403
    assert env.client("x" * 40).get("/v1/workers").status_code == 401
    assert w.get("/v1/workers").status_code == 403
    assert env.client(token).post("/v1/runs", json={}).status_code == 403
    r = env.admin.post(f"/v1/workers/{wid}/heartbeat", json={})
    assert r.status_code == 403
    reg2, w2 = env.enroll("gpu1")
    assert w2.post(f"/v1/workers/{wid}/heartbeat", json={}).status_code == 403
    import httpx

    assert httpx.get(env.url + "/v1/workers").status_code == 401
    assert httpx.get(env.url + "/v1/workers", headers={"Authorization": "Basic abc"}).status_code == 401

    # drain / resume
    assert w.post(f"/v1/workers/{wid}/drain").json()["state"] == "draining"
    assert w.post(f"/v1/workers/{wid}/heartbeat", json={}).json()["state"] == "draining"
    assert env.admin.post(f"/v1/workers/{wid}/resume").json()["state"] == "active"

    # lease expiry: stop heartbeating -> the reaper marks the worker lost and counts it
    wait_for(lambda: env.admin.get(f"/v1/workers/{wid}").json()["state"] == "lost", "lease expiry")
    m = metric_samples(env)
    assert m[("sparecycles_workers_lost_total", ())] >= 1
    assert m[("sparecycles_workers", (("state", "lost"),))] >= 1
    # a heartbeat revives it
    assert w.post(f"/v1/workers/{wid}/heartbeat", json={}).json()["state"] == "active"
    listing = {x["worker_id"]: x for x in env.admin.get("/v1/workers").json()}
    assert listing[wid]["version"] is None and listing[reg2["worker_id"]]["name"] == "gpu1"
    assert w2.delete(f"/v1/workers/{reg2['worker_id']}").status_code == 204
    assert w2.post(f"/v1/workers/{reg2['worker_id']}/heartbeat", json={}).status_code == 401
    rej = metric_samples(env)
    assert rej[("sparecycles_rejected_requests_total", (("reason", "unauthenticated"),))] >= 4
    assert rej[("sparecycles_rejected_requests_total", (("reason", "forbidden"),))] >= 4


def test_versions_blobs_etag_range_and_ledger(env: Env):
    env.create_run("gpt2-tiny", distribution="gauss8")
    payload = bytes(range(256)) * 1000
    manifest = env.publish_version("gpt2-tiny", 0, payload)
    sha = manifest["shards"][0]["sha256"]
    _reg, w = env.enroll("gpu0")
    got = w.get("/v1/runs/gpt2-tiny/versions/0").json()
    assert got["shards"] == manifest["shards"]
    full = w.get(f"/v1/blobs/{sha}")
    assert full.status_code == 200 and hashlib.sha256(full.content).hexdigest() == sha
    assert full.headers["etag"] == f'"{sha}"'
    assert w.get(f"/v1/blobs/{sha}", headers={"If-None-Match": f'"{sha}"'}).status_code == 304
    part = w.get(f"/v1/blobs/{sha}", headers={"Range": "bytes=1000-1999"})
    assert part.status_code == 206 and part.content == payload[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{len(payload)}"
    assert w.get(f"/v1/blobs/{'ab' * 32}").status_code == 404
    served = metric_samples(env)[("sparecycles_blob_bytes_served_total", ())]
    assert served == len(payload) + 1000
    # uploads: a claimed hash that does not match is refused and nothing is stored
    bad = env.admin.put(f"/v1/blobs/{'cd' * 32}", content=b"hello")
    assert bad.status_code == 422 and not (env.settings.blob_dir / "cd" / ("cd" * 32)).exists()
    ok = env.admin.post(
        "/v1/blobs", content=b"hello", headers={"X-Content-SHA256": hashlib.sha256(b"hello").hexdigest()}
    )
    assert ok.status_code == 201 and ok.json()["bytes"] == 5
    assert w.put(f"/v1/blobs/{hashlib.sha256(b'x').hexdigest()}", content=b"x").status_code == 403
    # a manifest naming a missing shard or a wrong size is refused; a conflicting re-registration too
    m2 = dict(manifest, version=1, parent=0, shards=[dict(manifest["shards"][0], bytes=7)])
    assert env.admin.post("/v1/runs/gpt2-tiny/versions", json=m2).status_code == 422
    m3 = dict(manifest, param_order_hash="1" * 64)
    assert env.admin.post("/v1/runs/gpt2-tiny/versions", json=m3).status_code == 409
    assert env.admin.post("/v1/runs/gpt2-tiny/versions", json=manifest).status_code == 201  # idempotent
    # seed ledger: linear, version == parent + 1 == latest + 1
    entry = {
        "run": "gpt2-tiny",
        "version": 1,
        "parent": 0,
        "seeds": [2**64 - 1, 5],
        "coeffs": [0.5, -0.25],
        "distribution": "gauss8",
        "scale": 0.999,
    }
    assert env.admin.post("/v1/runs/gpt2-tiny/ledger", json=entry).status_code == 201
    stale_parent = dict(entry, version=1, parent=0, seeds=[7])
    stale_parent["coeffs"] = [1.0]
    assert env.admin.post("/v1/runs/gpt2-tiny/ledger", json=stale_parent).status_code == 409
    assert (
        env.admin.post("/v1/runs/gpt2-tiny/ledger", json=dict(entry, version=2, parent=1)).status_code == 201
    )
    led = w.get("/v1/runs/gpt2-tiny/ledger", params={"since": 0}).json()
    assert [e["version"] for e in led] == [1, 2] and led[0]["seeds"][0] == 2**64 - 1
    assert w.get("/v1/runs/gpt2-tiny").json()["latest_version"] == 2
    assert w.get("/v1/runs/nope").status_code == 404


def test_round_tasks_land_on_celery_queue(env: Env):
    env.create_run("r1", seeds_per_task=3, spot_check_fraction=0.0)
    env.publish_version("r1", 0, b"weights")
    batch = env.upload(b"\x00\x01" * 512)
    seeds = [11, 12, 13, 14, 15, 16, 2**64 - 1]
    body = round_body("r1", "step-0", batch, seeds, want_clean=True)
    info = env.admin.post("/v1/runs/r1/rounds", json=body)
    assert info.status_code == 201 and info.json()["tasks_published"] == 3
    msgs = env.queue_messages("r1")
    assert [m["task"] for m in msgs] == ["sparecycles.probe"] * 3
    assert all(m["args"] == [] for m in msgs)
    assert [m["kwargs"]["seeds"] for m in msgs] == [[11, 12, 13], [14, 15, 16], [2**64 - 1]]
    k = msgs[0]["kwargs"]
    assert k == {
        "schema_version": 1,
        "run": "r1",
        "round_id": "step-0",
        "version": 0,
        "batch_sha256": batch,
        "eps": 1e-3,
        "distribution": "rademacher",
        "seeds": [11, 12, 13],
        "want_clean": True,
        "replica": 0,
        "kind": "seeded",
        "base_version": None,
    }  # a schema-1 task has no `blocks` field at all: byte-identical to what older workers accept
    again = env.admin.post("/v1/runs/r1/rounds", json=body)  # a retried POST publishes nothing twice
    assert again.status_code == 201 and again.json() == info.json() and len(env.queue_messages("r1")) == 3
    assert env.admin.post("/v1/runs/r1/rounds", json=dict(body, eps=1.0)).status_code == 409
    assert (
        env.admin.post("/v1/runs/r1/rounds", json=dict(body, round_id="x", batch_sha256="e" * 64)).status_code
        == 422
    )
    assert env.admin.post("/v1/runs/r1/rounds", json=dict(body, round_id="y", version=5)).status_code == 422
    m = metric_samples(env)
    assert m[("sparecycles_tasks_published_total", ())] == 3
    assert m[("sparecycles_queue_depth", (("run", "r1"),))] == 3
    reg, _ = env.enroll("gpu0")
    assert reg["queues"] == [f"{env.settings.queue_prefix}.r1"]


def test_every_intake_outcome_is_counted(env: Env):
    env.create_run("a", staleness=1, spot_check_fraction=0.0, seeds_per_task=4)
    env.publish_version("a", 0, b"v0")
    batch = env.upload(b"batch")
    rnd = round_body("a", "r0", batch, list(range(1, 9)), want_clean=True)
    assert env.admin.post("/v1/runs/a/rounds", json=rnd).status_code == 201
    reg, w = env.enroll("gpu0")
    wid = reg["worker_id"]
    seen: dict[str, int] = {}

    def post(results):
        resp = w.post("/v1/runs/a/results", json={"results": results})
        assert resp.status_code == 200, resp.text
        for o in resp.json()["outcomes"]:
            seen[o] = seen.get(o, 0) + 1
        return resp.json()["outcomes"]

    assert post([result("a", "r0", 1, wid, l0=1.5), result("a", "r0", 2, wid, l0=1.5)]) == ["accepted"] * 2
    assert post([result("a", "r0", 1, wid, l0=1.5)]) == ["duplicate"]
    assert post([result("a", "r0", 999, wid, l0=1.5)]) == ["unknown_seed"]
    assert post([result("a", "r0", 3, wid)]) == ["invalid"]  # want_clean but no l0
    assert post([result("a", "r0", 3, wid, l0=1.0, version=1)]) == ["invalid"]  # not the round's version
    assert post([result("a", "r0", 3, wid, l0=1.0, replica=1)]) == ["invalid"]  # not a spot-check seed
    assert post([result("a", "r0", 3, "w-0123456789abcdef", l0=1.0)]) == ["invalid"]  # another worker's id
    assert post([result("a", "nope", 3, wid, l0=1.0)]) == ["unknown_round"]
    gone = w.post("/v1/runs/gone/results", json={"results": [result("gone", "r0", 3, wid, l0=1.0)]})
    assert gone.status_code == 200 and gone.json()["outcomes"] == ["unknown_run"]  # a run it never had (or lost)
    seen["unknown_run"] = 1
    # a non-finite loss is that result's outcome (issue 14 case 4), not the batch's: see test_intake_partial
    nan = w.post(
        "/v1/runs/a/results",
        content=b'{"results": [' + b'{"run": "a", "round_id": "r0", "seed": 3, "l0": 1.0, '
        b'"version": 0, "worker_id": "' + wid.encode() + b'", "l_plus": NaN, "l_minus": 1.0}]}',
        headers={"content-type": "application/json"},
    )
    assert nan.status_code == 200 and nan.json()["outcomes"] == ["non_finite"]
    seen["non_finite"] = 1
    # only a bad envelope refuses the whole batch: 422, counted as a rejected request
    assert w.post("/v1/runs/a/results", json={"results": []}).status_code == 422
    env.publish_version("a", 1, b"v1")
    assert post([result("a", "r0", 3, wid, l0=1.0)]) == ["accepted"]  # age 1 <= S
    env.publish_version("a", 2, b"v2")
    assert post([result("a", "r0", 4, wid, l0=1.0)]) == ["stale"]  # age 2 > S = 1
    counts = env.admin.get("/v1/runs/a/intake").json()  # the trainer reads intake's judgement with its results
    assert (counts["duplicate"], counts["stale"]) == (1, 1)
    assert env.admin.get("/v1/runs/nope/intake").status_code == 404
    # publishing version 2 closed the stale round r0 (bounded open set); an explicit close counts too
    assert env.admin.get("/v1/runs/a").json()["open_rounds"] == []
    assert env.admin.post("/v1/runs/a/rounds", json=dict(rnd, round_id="r1", version=2)).status_code == 201
    assert env.admin.post("/v1/runs/a/rounds/r1/close").json()["state"] == "closed"
    assert post([result("a", "r1", 5, wid, l0=1.0, version=2)]) == ["closed_round"]
    # canary: results count only after attestation with the right digest
    digest = hashlib.sha256(b"z-canary").hexdigest()
    env.create_run(
        "c",
        spot_check_fraction=0.0,
        canary={"seed": 7, "numel": 4096, "distribution": "gauss8", "digest": digest},
    )
    env.publish_version("c", 0, b"c0")
    assert env.admin.post("/v1/runs/c/rounds", json=dict(rnd, run="c", want_clean=False)).status_code == 201
    def cpost(res):
        return w.post("/v1/runs/c/results", json={"results": res}).json()["outcomes"]
    outs = cpost([result("c", "r0", 1, wid)])
    assert outs == ["unattested"]
    seen["unattested"] = 1
    assert w.post("/v1/runs/c/attest", json={"worker_id": wid, "digest": "0" * 64}).status_code == 422
    assert w.post("/v1/runs/c/attest", json={"worker_id": wid, "digest": digest}).status_code == 200
    assert cpost([result("c", "r0", 1, wid)]) == ["accepted"]
    seen["accepted"] += 1
    # the unattested result's seed was re-sent to the queue (1 original task per 4 seeds + 1 redispatch)
    c_tasks = env.queue_messages("c")
    assert len(c_tasks) == 3 and c_tasks[-1]["kwargs"]["seeds"] == [1]

    m = metric_samples(env)
    for outcome, n in seen.items():
        assert m[("sparecycles_intake_results_total", (("outcome", outcome),))] == n, outcome
    assert m[("sparecycles_rejected_requests_total", (("reason", "validation"),))] >= 1
    assert m[("sparecycles_result_age_versions_count", ())] == 4
    assert m[("sparecycles_result_age_versions_sum", ())] == 1  # ages 0, 0, 1, 0
    # what reached the trainer: exactly the accepted results, in order, surviving a reader restart
    reader = ResultStreamReader(env.settings.redis_url, "a", key_prefix=env.settings.key_prefix)
    events = reader.read(count=100, block_ms=10)
    assert [(e.kind, e.seed) for _, e in events] == [("accepted", 1), ("accepted", 2), ("accepted", 3)]
    reader.ack([events[0][0]])
    restarted = ResultStreamReader(env.settings.redis_url, "a", key_prefix=env.settings.key_prefix)
    again = restarted.read(count=100, block_ms=10)
    assert [e.seed for _, e in again] == [2, 3]  # unacked entries are redelivered after a restart
    restarted.ack([i for i, _ in again])
    assert restarted.read(count=100, block_ms=10) == [] and restarted.pending() == 0
    assert restarted.trim() == 3


def test_results_of_a_run_the_store_lost_count_as_unknown_run(env: Env):
    """A run whose keys vanish (its store lost) while intake still caches its round: the result is refused by the
    intake script as `unknown_run`, counted under its own label, not as `unknown_round`."""
    env.create_run("l", staleness=4, spot_check_fraction=0.0, seeds_per_task=4)
    env.publish_version("l", 0, b"v0")
    rnd = round_body("l", "r0", env.upload(b"batch"), [1, 2, 3, 4])
    assert env.admin.post("/v1/runs/l/rounds", json=rnd).status_code == 201
    reg, w = env.enroll("gpu0")
    wid = reg["worker_id"]

    def post(seed: int) -> list[str]:
        resp = w.post("/v1/runs/l/results", json={"results": [result("l", "r0", seed, wid)]})
        assert resp.status_code == 200, resp.text
        return resp.json()["outcomes"]

    before = metric_samples(env)
    assert post(1) == ["accepted"]  # intake now holds the round in its cache
    keys = [k for k in env.r.scan_iter(f"{env.settings.key_prefix}:*", count=1000) if "{l}" in str(k)]
    assert keys
    env.r.delete(*keys)  # the run's whole state gone, the worker's kept
    assert post(2) == ["unknown_run"]
    m = metric_samples(env)

    def grew(outcome: str) -> float:
        key = ("sparecycles_intake_results_total", (("outcome", outcome),))
        return m[key] - before.get(key, 0.0)

    assert (grew("unknown_run"), grew("unknown_round"), grew("accepted")) == (1.0, 0.0, 1.0)


def test_spot_check_disagreement_quarantines_the_odd_one_out(env: Env):
    run, rid = "s", "r0"
    seeds = list(range(100, 140))
    spot = [s for s in seeds if spot_check_selected(run, rid, s, 0.5)]
    plain = [s for s in seeds if s not in spot]
    assert len(spot) >= 2 and len(plain) >= 1
    env.create_run(run, spot_check_fraction=0.5, spot_rtol=1e-6, spot_atol=0.0, seeds_per_task=64)
    env.publish_version(run, 0, b"w")
    batch = env.upload(b"b")
    body = round_body(run, rid, batch, seeds)
    assert env.admin.post(f"/v1/runs/{run}/rounds", json=body).json()["n_spot_checks"] == len(spot)
    tasks = env.queue_messages(run)
    assert [t["kwargs"]["replica"] for t in tasks] == [0, 1] and tasks[1]["kwargs"]["seeds"] == spot
    (ra, a), (rb, b), (rc, c) = env.enroll("honest"), env.enroll("liar"), env.enroll("tiebreak")
    A, B, C = ra["worker_id"], rb["worker_id"], rc["worker_id"]
    def post(cl, res):
        return cl.post(f"/v1/runs/{run}/results", json={"results": res}).json()["outcomes"]

    s0, s1 = spot[0], spot[1]
    # the liar evaluated a plain seed first (accepted, unverified) -> retracted once it is caught
    assert post(b, [result(run, rid, plain[0], B, lp=9.0, lm=9.0)]) == ["accepted"]
    # agreement: replica 0 by A, replica 1 by C -> streamed once, verified
    assert post(a, [result(run, rid, s0, A, lp=1.25, lm=1.5)]) == ["held"]
    assert post(a, [result(run, rid, s0, A, lp=1.25, lm=1.5, replica=1)]) == ["same_worker"]
    assert post(c, [result(run, rid, s0, C, lp=1.25, lm=1.5, replica=1)]) == ["held"]
    # disagreement: A says 1.25, B says 3.0 -> a third task for s1 with replica 2
    assert post(a, [result(run, rid, s1, A, lp=1.25, lm=1.5)]) == ["held"]
    assert post(b, [result(run, rid, s1, B, lp=3.0, lm=1.5, replica=1)]) == ["held"]
    third = [t["kwargs"] for t in env.queue_messages(run) if t["kwargs"]["replica"] == 2]
    assert [t["seeds"] for t in third] == [[s1]]
    assert post(c, [result(run, rid, s1, C, lp=1.25 * (1 + 1e-8), lm=1.5, replica=2)]) == ["held"]
    assert env.admin.get(f"/v1/workers/{B}").json()["state"] == "quarantined"
    assert env.admin.get(f"/v1/workers/{A}").json()["state"] == "active"
    assert post(b, [result(run, rid, plain[1], B)]) == ["quarantined"]
    assert b.post(f"/v1/workers/{B}/heartbeat", json={}).json()["state"] == "quarantined"

    reader = ResultStreamReader(env.settings.redis_url, run, key_prefix=env.settings.key_prefix)
    ev = [e for _, e in reader.read(count=100, block_ms=10)]
    assert [(e.kind, e.seed) for e in ev] == [
        ("accepted", plain[0]),
        ("accepted", s0),
        ("accepted", s1),
        ("retracted", plain[0]),
    ]
    assert ev[1].verified and ev[1].result.worker_id == A
    assert ev[2].verified and ev[2].result.worker_id == A and ev[2].result.l_plus == 1.25
    # the retracted seed and the refused one were re-sent for a fresh evaluation
    # queue: primaries, replica-1 spot tasks, s0 replica 1 again (same worker), s1 replica 2, then these
    q = [(t["kwargs"]["seeds"], t["kwargs"]["replica"]) for t in env.queue_messages(run)[2:]]
    assert q == [([s0], 1), ([s1], 2), ([plain[0]], 0), ([plain[1]], 0)]
    assert post(a, [result(run, rid, plain[0], A)]) == ["accepted"]
    m = metric_samples(env)
    assert m[("sparecycles_spot_checks_total", (("outcome", "agree"),))] == 1
    assert m[("sparecycles_spot_checks_total", (("outcome", "disagree"),))] == 1
    assert m[("sparecycles_spot_checks_total", (("outcome", "resolved"),))] == 1
    assert m[("sparecycles_workers_quarantined_total", ())] == 1
    assert m[("sparecycles_results_retracted_total", ())] == 1
    assert m[("sparecycles_intake_results_total", (("outcome", "same_worker"),))] == 1
    assert m[("sparecycles_workers", (("state", "quarantined"),))] == 1


def test_coordinator_restart_keeps_state_and_dedupe(tmp_path):
    """A second coordinator process on the same Redis continues the run: tokens, rounds and the dedupe
    record survive, a completed round is timed once, and nothing reaches the stream twice."""
    from api.app import create_app
    from api.server import ServerThread
    from support.coordinator import cleanup, make_settings

    settings = make_settings(tmp_path)
    try:
        import httpx
        import redis as _redis

        r = _redis.Redis.from_url(settings.redis_url, decode_responses=True)
        admin_h = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
        with ServerThread(create_app(settings)) as srv:
            env = Env(settings, srv.url, httpx.Client(base_url=srv.url, headers=admin_h), r)
            env.create_run("x", spot_check_fraction=0.0)
            env.publish_version("x", 0, b"w0")
            batch = env.upload(b"batch")
            rnd = round_body("x", "r", batch, [5, 6, 7], eps=0.01, distribution="gauss8")
            assert env.admin.post("/v1/runs/x/rounds", json=rnd).status_code == 201
            reg, w = env.enroll("gpu")
            wid = reg["worker_id"]
            out = w.post(
                "/v1/runs/x/results", json={"results": [result("x", "r", 5, wid), result("x", "r", 6, wid)]}
            )
            assert out.json()["outcomes"] == ["accepted", "accepted"]
        with ServerThread(create_app(settings)) as srv2:  # the "restarted" coordinator
            w2 = httpx.Client(base_url=srv2.url, headers={"Authorization": f"Bearer {reg['worker_token']}"})
            out = w2.post(
                "/v1/runs/x/results", json={"results": [result("x", "r", 6, wid), result("x", "r", 7, wid)]}
            )
            assert out.json()["outcomes"] == ["duplicate", "accepted"]
            info = w2.get("/v1/runs/x/rounds/r").json()
            assert info["done"] == 3 and info["n_seeds"] == 3
            text = httpx.get(srv2.url + "/metrics").text
            fams = {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if not s.labels
            }
            assert fams["sparecycles_round_latency_seconds_count"] == 1
        reader = ResultStreamReader(settings.redis_url, "x", key_prefix=settings.key_prefix)
        assert sorted(e.seed for _, e in reader.read(count=10, block_ms=10)) == [5, 6, 7]
    finally:
        cleanup(settings)
