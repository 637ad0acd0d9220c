"""Issue 14 case 6: a worker's broker credentials reach the Celery keys only, and stop at quarantine.

A private Valkey with a password (never the shared Redis: ACL users are created here), a real
coordinator (uvicorn in a thread) with `broker_acl` on, the worker's side through kombu's Redis
transport (the transport its Celery worker uses) with the credentials registration handed out.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest
import redis
from kombu import Connection

from api.app import create_app
from api.server import ServerThread
from coordinator.broker_acl import with_credentials, worker_acl_rules
from coordinator.settings import generate_dev_settings
from coordinator.store import Store
from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from support.fleet import AclFleet, make_batch
from support.models import tiny_gpt2 as tiny_model
from support.valkey import Valkey
from trainer.zo.probes import RoundSpec
from wire.messages import RunSpec


def test_rules_and_urls_are_pure():
    rules = worker_acl_rules(["sc.probe.a", "sparecycles.teacher.kd-1"], "pw")
    assert rules[:3] == ["reset", "on", ">pw"] and "-@dangerous" in rules
    assert "~sc.probe.a" in rules and "~sc.probe.a\x06\x16*" in rules and "~sparecycles.teacher.kd-1" in rules
    assert not any(r.startswith("~sc:") or r == "~*" or r == "allkeys" or r in ("~sc.probe.*", "~sparecycles.teacher.*")
                   for r in rules)
    assert worker_acl_rules(["q*?"], "pw")[3] == "~q\\*\\?"  # a name is matched as itself, never as a glob
    assert with_credentials("redis://:secret@h:6380/2", "w-1", "p/w") == "redis://w-1:p%2Fw@h:6380/2"
    ended = worker_acl_rules(["sc.probe.b"], "pw", ended=["sc.probe.a"])
    assert "%W~sc.probe.a" in ended and "%W~sc.probe.a\x06\x16*" in ended and "~sc.probe.b" in ended
    assert "~sc.probe.a" not in ended and "~sc.probe.a\x06\x16*" not in ended


@pytest.fixture
def fleet(tmp_path):
    v = Valkey(tmp_path / "valkey", password=secrets.token_urlsafe(16))
    v.start()
    settings = generate_dev_settings(
        redis_url=v.url,
        blob_dir=tmp_path / "blobs",
        broker_acl=True,
        key_prefix="sc",
        queue_prefix="sc.probe",
    )
    try:
        with ServerThread(create_app(settings)) as srv:
            yield settings, srv.url, v
    finally:
        v.stop()


def test_quarantined_worker_cannot_touch_registry_keys(fleet):
    settings, url, v = fleet
    enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
    admin = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
    )
    reg = httpx.post(f"{url}/v1/workers", json={"name": "w"}, headers=enroll).json()
    other = httpx.post(f"{url}/v1/workers", json={"name": "w2"}, headers=enroll).json()
    wid = reg["worker_id"]
    assert reg["broker_url"] != settings.redis_url and reg["broker_url"].startswith(f"redis://{wid}:")
    assert v.url.split("@")[0].split(":")[-1] not in reg["broker_url"]  # never the coordinator's password

    # the coordinator publishes a round's task; the worker takes it over kombu with its own credentials
    assert (
        admin.post(
            "/v1/runs", json={"run": "acl", "model_class": "M", "spot_check_fraction": 0.0}
        ).status_code
        == 201
    )
    sha = admin.post("/v1/blobs", content=b"w").json()["sha256"]
    manifest = {
        "run": "acl",
        "version": 0,
        "parent": None,
        "param_order_hash": "0" * 64,
        "dtype": "float32",
        "model_class": "M",
        "shards": [{"name": "m.safetensors", "sha256": sha, "bytes": 1}],
    }
    assert admin.post("/v1/runs/acl/versions", json=manifest).status_code == 201
    rnd = {
        "run": "acl",
        "round_id": "r0",
        "version": 0,
        "batch_sha256": sha,
        "eps": 1e-3,
        "distribution": "rademacher",
        "seeds": [1, 2],
    }
    assert admin.post("/v1/runs/acl/rounds", json=rnd).status_code == 201
    with Connection(reg["broker_url"]) as conn:
        q = conn.SimpleQueue("sc.probe.acl")
        msg = q.get(timeout=10)
        assert msg.headers["task"] == "sparecycles.probe" and msg.payload[1]["seeds"] == [1, 2]
        msg.requeue()  # a hand-back: LPUSH on the queue is allowed too
        q.get(timeout=10).ack()
        q.close()

    # ...and nothing else: registry keys, token digests, other workers, admin commands
    w = redis.Redis.from_url(reg["broker_url"], decode_responses=True)
    for attempt in (
        lambda: w.hget(f"sc:w:{wid}", "state"),
        lambda: w.hset(f"sc:w:{wid}", "state", "active"),
        lambda: w.hget(f"sc:w:{other['worker_id']}", "token_sha256"),
        lambda: w.smembers("sc:workers"),
        lambda: w.keys("*"),
        lambda: w.config_get("*"),
        lambda: w.acl_list(),
        lambda: w.flushall(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert w.llen("sc.probe.acl") == 0  # its queue it may read

    # quarantine disables the user: the open connection is closed and a new login refused
    Store(settings).workers.set_worker_state(wid, "quarantined", ("active", "draining", "lost"), actor="coordinator")
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError)):
        w.llen("sc.probe.acl")
    fresh = redis.Redis.from_url(reg["broker_url"])
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        fresh.ping()
    root = redis.Redis.from_url(v.url, decode_responses=True)
    assert root.hget(f"sc:w:{wid}", "state") == "quarantined"  # still quarantined: it could not undo it
    # deletion removes the user; the other worker's user is untouched
    assert admin.delete(f"/v1/workers/{wid}").status_code == 204
    assert root.acl_getuser(wid) is None and root.acl_getuser(other["worker_id"])["enabled"]
    admin.close()


@pytest.fixture
def acl_worker(tmp_path):
    """A private Valkey with a password, a coordinator with broker ACLs on it (support.fleet.AclFleet) and its
    probe-worker process "a" consuming: yields (the Valkey, the fleet, the worker's id); stops both."""
    v = Valkey(tmp_path / "valkey", password=secrets.token_urlsafe(16))
    v.start()
    fleet = AclFleet(tmp_path, v.url)
    try:
        fleet.start_worker("a")
        yield v, fleet, fleet.wait_consuming("a")
    finally:
        fleet.close()
        v.stop()


@pytest.mark.slow
def test_real_worker_process_runs_rounds_with_its_own_broker_user(acl_worker, tmp_path):
    """A probe-worker process (Celery) evaluates rounds with only its ACL user's rights, also across an
    8 s broker outage with a Redis restart (issue 14 case 5 end to end)."""
    v, fleet, wid = acl_worker
    root = redis.Redis.from_url(v.url, decode_responses=True)
    assert root.acl_getuser(wid)["enabled"]
    model = tiny_model()
    run = RunSpec(
        run="aclrun", model_class=type(model).__name__, spot_check_fraction=0.0, seeds_per_task=2
    )
    be = CoordinatorBackend.connect(model, run, FleetAddress(fleet.url, fleet.admin_token, v.url, fleet.prefix),
                                    BackendTuning(round_timeout_s=120.0))
    be.publish(0)
    seeds = tuple(range(100, 106))
    be.submit(RoundSpec("acl-0", 0, make_batch(2, 8, seed=1), eps=1e-2, seeds=seeds, distribution="rademacher"))
    got = be.collect("acl-0").results
    assert sorted(r.seed for r in got) == list(seeds) and {r.worker for r in got} == {wid}

    # an 8 s broker outage mid-run, Redis restarted (which forgets ACL users created at run time):
    # the coordinator re-creates the worker's user, the worker reconnects, the trainer's round ends
    seeds = tuple(range(200, 212))
    be.submit(RoundSpec("acl-1", 0, make_batch(2, 8, seed=2), eps=1e-2, seeds=seeds, distribution="rademacher"))
    v.stop()
    time.sleep(8.0)  # the outage lasts this long (not an assertion on timing)
    v.start()
    got = be.collect("acl-1").results
    assert sorted(r.seed for r in got) == list(seeds) and {r.worker for r in got} == {wid}
    # The round may complete before the coordinator notices the restart (the worker can have taken every
    # task before the outage): wait for the re-creation itself, bounded, rather than racing it.
    deadline = time.monotonic() + 60
    restored = False
    while not restored and time.monotonic() < deadline:
        user = redis.Redis.from_url(v.url, decode_responses=True).acl_getuser(wid)
        restored = bool(user and user["enabled"]) and "the broker restarted: 1 broker users re-created" in (
            tmp_path / "coordinator.log").read_text()
        if not restored:
            time.sleep(0.5)
    assert restored, "the coordinator did not re-create the worker's broker user after the restart"
    be.close()
    log = (tmp_path / "a.log").read_text()
    assert "NOPERM" not in log and "No permissions" not in log


@pytest.mark.slow
def test_a_real_worker_refused_one_runs_queue_goes_on_with_the_other(acl_worker, tmp_path):
    """A probe-worker process (Celery, kombu's channel of probe_worker.broker) consumes two runs' queues; one queue is
    withdrawn from its broker user while it still consumes it (as between a run's end and the worker's next control
    tick, here held open: the run is still listed): Redis refuses its BRPOP with NOPERM, which used to end the worker
    ("Unrecoverable error"). It leaves that queue out, lives on and evaluates the other run's round; after the run's
    end it stops consuming the ended queue."""
    v, fleet, wid = acl_worker
    model = tiny_model()
    address = FleetAddress(fleet.url, fleet.admin_token, v.url, fleet.prefix)
    backends = {run: CoordinatorBackend.connect(
        model, RunSpec(run=run, model_class=type(model).__name__, spot_check_fraction=0.0, seeds_per_task=2),
        address, BackendTuning(round_timeout_s=120.0)) for run in ("gone", "kept")}
    for be in backends.values():
        be.publish(0)
    log = tmp_path / "a.log"
    gone, kept = f"{fleet.prefix}.probe.gone", f"{fleet.prefix}.probe.kept"
    fleet.wait(lambda: f"consuming {gone}" in log.read_text() and f"consuming {kept}" in log.read_text(),
               "the worker consuming both runs' queues")
    root = redis.Redis.from_url(v.url, decode_responses=True)
    settings = generate_dev_settings(redis_url=v.url, blob_dir=tmp_path / "blobs", broker_acl=True,
                                     key_prefix=fleet.prefix, queue_prefix=f"{fleet.prefix}.probe",
                                     admin_token=fleet.admin_token)
    assert Store(settings).workers.revoke_queue(gone) == 1
    fleet.wait(lambda: f"refused this worker's user on {gone}" in log.read_text(), "the worker leaving the queue")
    seeds = tuple(range(300, 306))
    backends["kept"].submit(RoundSpec("kept-0", 0, make_batch(2, 8, seed=3), eps=1e-2, seeds=seeds,
                                      distribution="rademacher"))
    got = backends["kept"].collect("kept-0").results
    assert sorted(r.seed for r in got) == list(seeds) and {r.worker for r in got} == {wid}
    assert fleet.workers["a"].poll() is None and "Unrecoverable error" not in log.read_text()
    backends["gone"].close(end=True)
    fleet.wait(lambda: f"stopped consuming {gone}" in log.read_text(), "the worker cancelling the ended queue")
    assert root.acl_getuser(wid)["enabled"] and fleet.workers["a"].poll() is None
    backends["kept"].close()


def _register_teacher_run(admin: httpx.Client, run: str) -> None:
    """A teacher run at the coordinator: a one-file 'teacher' uploaded as a blob, then POST /v1/teachers."""
    import hashlib

    data = b"{}"
    sha = admin.put(f"/v1/blobs/{hashlib.sha256(data).hexdigest()}", content=data).json()["sha256"]
    body = {"run": run, "teacher": {"teacher_sha256": "1" * 64,
                                    "files": [{"name": "config.json", "size": 2, "sha256": sha}]}}
    assert admin.post("/v1/teachers", json=body).status_code == 201


def test_a_workers_broker_user_gets_exactly_its_runs_queues_and_writes_targets_only(fleet):
    """Issues 47: the per-worker user takes the queues of the runs registered at its coordinator, probe and teacher
    runs, those registered before it enrolled and after (granted before it is told of them); a queue of any other run
    (probe or teacher) is refused. It may write target blobs (`sc:kd:*`, SET NX; EXISTS, which reads no value, is
    allowed), but never read one back (GET/GETDEL: another run's targets), the registry, or a run's results."""
    from wire.teacher_messages import target_key, teacher_queue

    settings, url, v = fleet
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"})
    assert admin.post("/v1/runs", json={"run": "before", "model_class": "M"}).status_code == 201
    _register_teacher_run(admin, "kd-before")
    enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
    reg = httpx.post(f"{url}/v1/workers", json={"name": "t"}, headers=enroll).json()
    assert reg["queues"] == ["sc.probe.before"] and reg["teacher_queues"] == [teacher_queue("kd-before")]
    assert admin.post("/v1/runs", json={"run": "after", "model_class": "M"}).status_code == 201
    _register_teacher_run(admin, "kd-after")
    root = redis.Redis.from_url(v.url)
    me = redis.Redis.from_url(reg["broker_url"])
    mine = ["sc.probe.before", "sc.probe.after", teacher_queue("kd-before"), teacher_queue("kd-after")]
    for queue in mine:
        root.lpush(queue, b"round")
        assert me.brpop([queue], timeout=1) == (queue.encode(), b"round")
        me.lpush(queue + "\x06\x163", b"hand-back")  # kombu's priority sub-queue of it
    hb = httpx.post(f"{url}/v1/workers/{reg['worker_id']}/heartbeat", json={"busy": False},
                    headers={"Authorization": f"Bearer {reg['worker_token']}"}).json()
    assert sorted(hb["queues"] + hb["teacher_queues"]) == sorted(mine)
    others = ["sc.probe.other", "sc.probe.befor", "sc.probe.before2", teacher_queue("kd-other"),
              teacher_queue("kd-before2"), "sc.probe.*"]
    for queue in others:  # another run's queue, never created or registered here; a name one letter off
        root.lpush(queue, b"round")
        for refused in (lambda q=queue: me.brpop([q], timeout=1), lambda q=queue: me.lpush(q, b"x"),
                        lambda q=queue: me.brpop(["sc.probe.before", q], timeout=1)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
                pytest.fail(f"{queue} was allowed")
        assert root.llen(queue) == 1
    key = target_key("kd-before", 0, "topk16-t1.0-s0", 7)
    assert me.set(key, b"blob", nx=True, ex=60) and not me.set(key, b"other", nx=True, ex=60)
    assert root.get(key) == b"blob" and me.exists(key) == 1
    root.set("sc:results:run", b"r")
    for name, refused in [("GET", lambda: me.get(key)), ("GETDEL", lambda: me.getdel(key)),
                          ("teachers", lambda: me.hgetall("sc:teachers")),
                          ("registry", lambda: me.smembers("sc:workers")), ("results", lambda: me.get("sc:results:run")),
                          ("results SET", lambda: me.set("sc:results:run", b"x"))]:
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
            pytest.fail(f"{name} was allowed")
    assert root.get(key) == b"blob" and root.get("sc:results:run") == b"r"
    # a Redis restart forgets the user: restored with the queues registered now, the others still refused
    root.execute_command("ACL", "DELUSER", reg["worker_id"])
    assert Store(settings).workers.restore_broker_users() == 1
    me = redis.Redis.from_url(reg["broker_url"])
    assert me.llen(teacher_queue("kd-after")) == 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        me.llen("sc.probe.other")
    admin.close()


def test_ending_a_run_withdraws_its_queue_from_every_workers_broker_user(fleet):
    """Ending a run (probe or teacher) at the coordinator: each worker's broker credentials are refused taking from its
    queue by Redis itself (NOPERM), on a connection opened before the end too, and after re-enrolment or a broker
    restart; a task in flight at the end is still handed back (kombu's requeue, a MULTI with LPUSH). Every other grant
    stays: the other runs' queues, a run created afterwards, the kombu keys. Ending twice changes nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    from wire.teacher_messages import teacher_queue

    settings, url, v = fleet
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"})
    for run in ("a", "b"):
        assert admin.post("/v1/runs", json={"run": run, "model_class": "M"}).status_code == 201
    _register_teacher_run(admin, "kd-a")
    enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
    regs = [httpx.post(f"{url}/v1/workers", json={"name": n}, headers=enroll).json() for n in ("x", "y")]
    root = redis.Redis.from_url(v.url)
    me = redis.Redis.from_url(regs[0]["broker_url"])  # opened before the end, kept open across it
    assert me.ping()

    # a task of run a in flight (taken over kombu, not acknowledged) when the run ends
    with Connection(v.url) as conn:
        conn.SimpleQueue("sc.probe.a").put({"round": "a-0"})
    with Connection(regs[0]["broker_url"]) as conn:
        q = conn.SimpleQueue("sc.probe.a")
        msg = q.get(timeout=10)
        assert msg.payload == {"round": "a-0"}
        reply = admin.post("/v1/runs/a/end").json()
        assert reply["revoked_broker_users"] == 2 and reply["purged_tasks"] == 0
        msg.requeue()  # the hand-back still works: LPUSH inside kombu's MULTI, onto the ended queue
        q.close()
    assert root.llen("sc.probe.a") == 1

    def refused(client: redis.Redis, queue: str) -> None:
        for take in (lambda: client.brpop([queue], timeout=1), lambda: client.rpop(queue),
                     lambda: client.lrange(queue, 0, -1), lambda: client.brpop(["sc.probe.b", queue], timeout=1),
                     lambda: client.rpop(queue + "\x06\x163")):
            with pytest.raises(redis.exceptions.NoPermissionError):  # redis-py's class for a NOPERM reply
                take()
                pytest.fail(f"{queue} could still be taken from")

    def allowed(client: redis.Redis, queues: list[str]) -> None:
        for queue in queues:
            root.lpush(queue, b"round")
            assert client.brpop([queue], timeout=1) == (queue.encode(), b"round")
        client.delete("_kombu.binding.x")  # kombu's keys still
        assert client.hlen("unacked") == 0 and client.sadd("_kombu.binding.x", "y") == 1

    for reg in regs:
        refused(redis.Redis.from_url(reg["broker_url"]), "sc.probe.a")
        allowed(redis.Redis.from_url(reg["broker_url"]), ["sc.probe.b", teacher_queue("kd-a")])
    refused(me, "sc.probe.a")
    assert root.llen("sc.probe.a") == 1  # the handed-back task is still there: nobody took it

    # ending twice: no change, nothing counted again; a run created afterwards is granted as before
    assert admin.post("/v1/runs/a/end").json()["revoked_broker_users"] == 0
    assert admin.post("/v1/runs", json={"run": "c", "model_class": "M"}).status_code == 201
    allowed(me, ["sc.probe.b", "sc.probe.c"])
    refused(me, "sc.probe.a")

    # a teacher run's end withdraws its queue the same way
    assert admin.post("/v1/teachers/kd-a/end").json() == {"run": "kd-a", "ended": True, "revoked_broker_users": 2}
    refused(me, teacher_queue("kd-a"))
    assert admin.post("/v1/teachers/kd-a/end").json()["revoked_broker_users"] == 0

    # a worker enrolled after the end, and a user re-created after a broker restart, hold the same rules
    late = httpx.post(f"{url}/v1/workers", json={"name": "z"}, headers=enroll).json()
    root.execute_command("ACL", "DELUSER", regs[1]["worker_id"])
    assert Store(settings).workers.restore_broker_users() == 1
    for reg in (late, regs[1]):
        client = redis.Redis.from_url(reg["broker_url"])
        refused(client, "sc.probe.a")
        refused(client, teacher_queue("kd-a"))
        allowed(client, ["sc.probe.b", "sc.probe.c"])

    samples = {s.name: s.value for fam in text_string_to_metric_families(admin.get("/metrics").text)
               for s in fam.samples}
    assert samples["sparecycles_broker_grants_revoked_total"] == 4  # 2 users x (run a, teacher run kd-a)
    admin.close()


def test_a_workers_channel_leaves_an_ended_runs_queue_and_keeps_taking_the_others(fleet, caplog):
    """The worker's kombu channel (probe_worker.broker, the transport its Celery worker uses) consumes runs a and b
    when a ends: its next BRPOP, still naming a (the worker's control loop has not cancelled that consumer yet), is
    refused by Redis (NOPERM), which would otherwise end the worker; the channel leaves a out, logs it and takes b's
    task, and goes on taking b's."""
    import contextlib
    import socket

    from kombu import Consumer, Exchange, Queue

    from probe_worker.broker import GuardedRedisTransport

    settings, url, v = fleet
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"})
    for run in ("a", "b"):
        assert admin.post("/v1/runs", json={"run": run, "model_class": "M"}).status_code == 201
    enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
    reg = httpx.post(f"{url}/v1/workers", json={"name": "x"}, headers=enroll).json()
    got: list[dict] = []

    def on_message(body: dict, message) -> None:
        got.append(body)
        message.ack()

    def drain_until(n: int) -> None:
        for _ in range(3):  # a refused BRPOP returns without a message; the next one takes it
            if len(got) >= n:
                return
            with contextlib.suppress(socket.timeout):
                conn.drain_events(timeout=5)
        assert len(got) >= n, got

    queues = [Queue(q, Exchange(q, "direct"), routing_key=q) for q in ("sc.probe.a", "sc.probe.b")]
    with Connection(v.url) as root, Connection(reg["broker_url"], transport=GuardedRedisTransport) as conn:
        with Consumer(conn, queues, callbacks=[on_message], accept=["json"]):
            root.SimpleQueue("sc.probe.a").put({"task": "a-0"})
            drain_until(1)
            assert admin.post("/v1/runs/a/end").json()["revoked_broker_users"] == 1
            root.SimpleQueue("sc.probe.b").put({"task": "b-0"})
            with caplog.at_level("WARNING", logger="probe_worker.broker"):
                drain_until(2)
            assert got == [{"task": "a-0"}, {"task": "b-0"}]
            assert "refused this worker's user on sc.probe.a" in caplog.text
            root.SimpleQueue("sc.probe.b").put({"task": "b-1"})
            drain_until(3)
            assert got[-1] == {"task": "b-1"}
    admin.close()


def test_an_ended_runs_write_only_rule_is_retired_after_its_window(fleet):
    """An ended run's queue stays write only in every worker's broker user for the retirement window (a task in flight
    at the end is handed back), then the reaper's `retire_ended_queues` drops the rule (the users' key patterns are
    exactly the live runs' again, also after a broker restart), deletes the tasks handed back meanwhile and the unacked
    entry of a worker that died holding one of its tasks (else a worker's restore sweep would be refused on it), and
    does so once. The clock is driven through `now`, from the end time the coordinator recorded."""
    settings, url, v = fleet
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"})
    for run in ("a", "b"):
        assert admin.post("/v1/runs", json={"run": run, "model_class": "M"}).status_code == 201
    enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
    regs = [httpx.post(f"{url}/v1/workers", json={"name": n}, headers=enroll).json() for n in ("x", "y")]
    wids = [reg["worker_id"] for reg in regs]
    root = redis.Redis.from_url(v.url, decode_responses=True)
    workers = Store(settings).workers
    window = settings.ended_queue_retire_s
    assert window == 2 * 3600  # the defaults: two visibility timeouts

    kombu_keys = ["~_kombu.*", "~unacked", "~unacked_index", "~unacked_mutex", "~*.celery.pidbox*",
                  "~sparecycles.idle*", "~sparecycles.default*", "%W~sc:kd:*"]
    live_b = ["~sc.probe.b", "~sc.probe.b\x06\x16*"]
    ended_a = ["%W~sc.probe.a", "%W~sc.probe.a\x06\x16*"]

    def keys_of(wid: str) -> list[str]:
        return root.acl_getuser(wid)["keys"]

    with Connection(v.url) as conn:
        for run, task in (("a", "a-0"), ("a", "a-1"), ("b", "b-0")):
            conn.SimpleQueue(f"sc.probe.{run}").put({"task": task})
    # worker x holds a-0 across the end; a worker that dies (no restore at shutdown, as at SIGKILL) holds a-1 and b-0,
    # left in kombu's `unacked`
    live = Connection(regs[0]["broker_url"])
    held = live.SimpleQueue("sc.probe.a").get(timeout=10)
    assert held.payload == {"task": "a-0"}
    for run, task in (("a", "a-1"), ("b", "b-0")):
        with Connection(regs[0]["broker_url"]) as dead:
            q = dead.SimpleQueue(f"sc.probe.{run}")
            assert q.get(timeout=10).payload == {"task": task}
            q.channel.qos.restore_at_shutdown = False
            q.close()
    assert root.hlen("unacked") == 3

    assert admin.post("/v1/runs/a/end").json()["revoked_broker_users"] == 2
    t_end = float(root.hget("sc:broker_queues_ended", "sc.probe.a"))
    for wid in wids:
        assert keys_of(wid) == [*live_b, *ended_a, *kombu_keys]

    # within the window: nothing retired, the hand-backs go through (kombu's requeue, a MULTI with LPUSH; a plain
    # LPUSH as the other worker's user)
    assert workers.retire_ended_queues(now=t_end + window - 1) == []
    held.requeue()
    live.close()
    me = redis.Redis.from_url(regs[1]["broker_url"])
    assert me.lpush("sc.probe.a", b"handed back") == 2
    for wid in wids:
        assert keys_of(wid) == [*live_b, *ended_a, *kombu_keys]
    assert root.hget("sc:broker_queues", "sc.probe.a") == "w"

    # at the window's end: retired once, leftovers deleted, the other run's unacked task kept
    assert workers.retire_ended_queues(now=t_end + window) == ["sc.probe.a"]
    for wid in wids:
        assert keys_of(wid) == [*live_b, *kombu_keys]
    assert root.hgetall("sc:broker_queues") == {"sc.probe.b": "rw"} and root.hgetall("sc:broker_queues_ended") == {}
    assert root.exists("sc.probe.a") == 0
    assert [json.loads(raw)[2] for raw in root.hvals("unacked")] == ["sc.probe.b"] and root.zcard("unacked_index") == 1
    assert workers.retire_ended_queues(now=t_end + 10 * window) == []

    # a worker's restore sweep (kombu's, as its user) hands b-0 back; nothing of run a is left to be refused on
    with Connection(regs[1]["broker_url"], transport_options={"visibility_timeout": 1e-3}) as conn:
        conn.default_channel.qos.restore_visible(num=10, interval=1)
    assert root.hlen("unacked") == 0 and root.llen("sc.probe.b") == 1
    for refused in (lambda: me.brpop(["sc.probe.a"], timeout=1), lambda: me.lpush("sc.probe.a", b"x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    assert me.brpop(["sc.probe.b"], timeout=1)[0] == b"sc.probe.b"

    # a broker restart re-creates a user without the retired rule
    root.execute_command("ACL", "DELUSER", wids[0])
    assert workers.restore_broker_users() == 1
    assert keys_of(wids[0]) == [*live_b, *kombu_keys]

    # a mark from before ends were recorded: its window starts at the first sweep that sees it
    root.hset("sc:broker_queues", "sc.probe.old", "w")
    assert workers.retire_ended_queues() == []
    t_old = float(root.hget("sc:broker_queues_ended", "sc.probe.old"))
    assert workers.retire_ended_queues(now=t_old + window - 1) == []
    assert workers.retire_ended_queues(now=t_old + window) == ["sc.probe.old"]
    admin.close()


def test_the_retirement_window_is_whole_visibility_timeouts_and_at_least_one():
    from pydantic import ValidationError

    from coordinator.settings import CoordinatorSettings, settings_problems

    assert generate_dev_settings(visibility_timeout_s=600, ended_queue_retire_timeouts=3).ended_queue_retire_s == 1800
    with pytest.raises(ValidationError) as exc:
        generate_dev_settings(ended_queue_retire_timeouts=0)
    assert settings_problems(exc.value, CoordinatorSettings) == [
        "SPARECYCLES_ENDED_QUEUE_RETIRE_TIMEOUTS: Input should be greater than or equal to 1"]


def test_the_coordinators_reaper_retires_an_ended_queue_and_counts_it(tmp_path):
    """The wiring: the running coordinator's reaper calls `retire_ended_queues` on its own clock and counts each
    retirement in `sparecycles_broker_queues_retired_total`. A one-second window (visibility timeout 1 s, one
    timeout) so the real clock passes it; waited for, bounded, never timed."""
    from prometheus_client.parser import text_string_to_metric_families

    v = Valkey(tmp_path / "valkey", password=secrets.token_urlsafe(16))
    v.start()
    settings = generate_dev_settings(redis_url=v.url, blob_dir=tmp_path / "blobs", broker_acl=True, key_prefix="sc",
                                     queue_prefix="sc.probe", visibility_timeout_s=1, ended_queue_retire_timeouts=1)
    try:
        with ServerThread(create_app(settings)) as srv:
            admin = httpx.Client(base_url=srv.url,
                                 headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"})
            assert admin.post("/v1/runs", json={"run": "a", "model_class": "M"}).status_code == 201
            enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
            wid = httpx.post(f"{srv.url}/v1/workers", json={"name": "x"}, headers=enroll).json()["worker_id"]
            root = redis.Redis.from_url(v.url, decode_responses=True)
            assert admin.post("/v1/runs/a/end").json()["revoked_broker_users"] == 1

            def retired() -> float:
                return next(s.value for fam in text_string_to_metric_families(admin.get("/metrics").text)
                            for s in fam.samples if s.name == "sparecycles_broker_queues_retired_total")

            deadline = time.monotonic() + 60
            while retired() == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert retired() == 1
            assert not [k for k in root.acl_getuser(wid)["keys"] if "sc.probe.a" in k]
            assert root.hgetall("sc:broker_queues") == {}
            admin.close()
    finally:
        v.stop()
