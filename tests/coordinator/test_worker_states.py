"""Issue 14 cases 2 and 7: worker records under concurrency, sticky admin states, registration bounds.

Real coordinator (uvicorn in a thread) on the shared Redis (a private key prefix per test).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.coordinator import Env, running_env
from wire.messages import Heartbeat


@pytest.fixture
def env(tmp_path):
    yield from running_env(
        tmp_path, max_workers_per_enrollment=5, registrations_per_minute=7, lost_expiry_leases=2
    )


def _store(env: Env):
    from coordinator.store import Store

    return Store(env.settings)


def test_concurrent_heartbeat_and_delete_never_500_nor_resurrect(env: Env):
    store = _store(env)
    statuses: list[int] = []
    for i in range(4):
        reg, w = env.enroll(f"race{i}")
        wid = reg["worker_id"]
        first = threading.Event()
        stop = threading.Event()

        def beat(w=w, wid=wid, first=first, stop=stop) -> None:
            while not stop.is_set():
                statuses.append(w.post(f"/v1/workers/{wid}/heartbeat", json={"busy": True}).status_code)
                statuses.append(env.admin.get(f"/v1/workers/{wid}").status_code)
                first.set()

        def direct(wid=wid, stop=stop) -> None:  # the store itself, without HTTP: the tightest race
            while not stop.is_set():
                try:
                    store.workers.heartbeat(wid, Heartbeat())
                except LookupError:
                    pass

        threads = [threading.Thread(target=beat), threading.Thread(target=direct)]
        for t in threads:
            t.start()
        first.wait(30)
        statuses.append(env.admin.delete(f"/v1/workers/{wid}").status_code)
        for _ in range(10):  # keep racing on the deleted worker for a few more rounds
            statuses.append(env.admin.get("/v1/workers").status_code)
        stop.set()
        for t in threads:
            t.join(30)
        w.close()
        assert not env.r.exists(store.keys.k_worker(wid)), "a heartbeat recreated a deleted worker"
        assert env.r.zscore(store.keys.k_leases, wid) is None and not env.r.sismember(store.keys.k_workers, wid)
    assert set(statuses) <= {200, 204, 401, 404}, sorted(set(statuses))
    assert 500 not in statuses and statuses.count(204) == 4
    # a partial record (not written by a registry script) reads as absent, never as a 500
    env.r.hset(store.keys.k_worker("w-00000000000000ff"), "accepted", 3)
    env.r.sadd(store.keys.k_workers, "w-00000000000000ff")
    assert env.admin.get("/v1/workers/w-00000000000000ff").status_code == 404
    assert env.admin.get("/v1/workers").status_code == 200


def test_admin_drain_and_quarantine_are_sticky(env: Env):
    store = _store(env)
    reg, w = env.enroll("sticky")
    wid = reg["worker_id"]
    # the worker's own drain: it may resume it
    assert w.post(f"/v1/workers/{wid}/drain").json()["state"] == "draining"
    assert w.post(f"/v1/workers/{wid}/resume").json()["state"] == "active"
    # an admin's drain: the worker cannot resume it, nor overwrite it with its own drain
    assert env.admin.post(f"/v1/workers/{wid}/drain").json()["state"] == "draining"
    assert w.post(f"/v1/workers/{wid}/drain").status_code == 200
    refused = w.post(f"/v1/workers/{wid}/resume")
    assert refused.status_code == 409 and "admin" in refused.json()["detail"]
    assert w.post(f"/v1/workers/{wid}/heartbeat", json={}).json()["state"] == "draining"
    # ...nor by being lost and coming back: it comes back draining
    assert store.workers.reap_expired(now=time.time() + env.settings.lease_seconds + 1) == [wid]
    assert env.admin.get(f"/v1/workers/{wid}").json()["state"] == "lost"
    assert w.post(f"/v1/workers/{wid}/heartbeat", json={}).json()["state"] == "draining"
    assert env.admin.post(f"/v1/workers/{wid}/resume").json()["state"] == "active"
    # quarantine (intake's transition) is left only by deletion
    store.workers.set_worker_state(wid, "quarantined", ("active", "draining", "lost"), actor="coordinator")
    for path in ("resume", "drain"):
        assert w.post(f"/v1/workers/{wid}/{path}").status_code == 409
        assert env.admin.post(f"/v1/workers/{wid}/{path}").status_code == 409
    assert w.post(f"/v1/workers/{wid}/heartbeat", json={}).json()["state"] == "quarantined"
    assert env.admin.delete(f"/v1/workers/{wid}").status_code == 204


def test_registration_cap_rate_expiry_and_pagination(env: Env):
    store = _store(env)
    enroll = env.client(env.settings.enrollment_token.get_secret_value())
    regs = [enroll.post("/v1/workers", json={"name": f"n{i}"}) for i in range(6)]
    assert [r.status_code for r in regs] == [201] * 5 + [429]
    assert (
        "MAX_WORKERS_PER_ENROLLMENT" in regs[5].json()["detail"] and int(regs[5].headers["retry-after"]) > 0
    )
    ids = sorted(r.json()["worker_id"] for r in regs[:5])

    # GET /v1/workers is paginated: pages of 2 chained by X-Next-After
    seen, after = [], ""
    for _ in range(5):
        page = env.admin.get("/v1/workers", params={"limit": 2, "after": after})
        seen += [x["worker_id"] for x in page.json()]
        after = page.headers.get("x-next-after")
        if after is None:
            break
    assert seen == ids
    assert env.admin.get("/v1/workers", params={"limit": 0}).status_code == 422

    # lost workers expire after lost_expiry_leases leases, which frees the token's cap
    lease = env.settings.lease_seconds
    for wid in ids[:3]:
        env.r.zadd(store.keys.k_leases, {wid: time.time() - 1})  # as if they stopped heartbeating
    t0 = time.time()
    store.workers.reap_expired(now=t0)  # (or the app's own reaper, whichever runs first)
    states = {x["worker_id"]: x["state"] for x in env.admin.get("/v1/workers").json()}
    assert states == {**dict.fromkeys(ids[:3], "lost"), **dict.fromkeys(ids[3:], "active")}
    store.workers.reap_expired(now=t0 + 2 * lease - 5)  # before their expiry: kept
    assert len(env.admin.get("/v1/workers").json()) == 5
    store.workers.reap_expired(now=t0 + 2 * lease + 5)
    assert [x["worker_id"] for x in env.admin.get("/v1/workers").json()] == ids[3:]
    assert env.admin.get(f"/v1/workers/{ids[0]}").status_code == 404

    # the rate limit (7 per minute): registrations 7 fits the freed cap, 8 is refused by rate
    assert enroll.post("/v1/workers", json={"name": "n7"}).status_code == 201
    rate = enroll.post("/v1/workers", json={"name": "n8"})
    assert rate.status_code == 429 and "REGISTRATIONS_PER_MINUTE" in rate.json()["detail"]
    text = httpx.get(env.url + "/metrics").text
    assert 'sparecycles_rejected_requests_total{reason="enrollment_cap"} 1.0' in text
    assert 'sparecycles_rejected_requests_total{reason="registration_rate"} 1.0' in text
    enroll.close()
