"""One host, one blob directory: the trainer writes weight shards into the coordinator's store and workers read
them in place (fleet.uploads.BlobSender blob_dir, probe_worker.cache shared_blob_dir); anything else falls back to HTTP."""

from __future__ import annotations

import shutil

import pytest
import torch
from prometheus_client import CollectorRegistry

from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from probe_worker.cache import WeightCache
from probe_worker.metrics import WorkerMetrics
from support.worker_env import REDIS_URL, params_of, tiny_model, worker_env
from wire.messages import RunSpec


@pytest.fixture
def env(tmp_path):
    yield from worker_env(tmp_path)


def _backend(env, model, run: str, blob_dir) -> CoordinatorBackend:  # noqa: F811
    return CoordinatorBackend.connect(
        model, RunSpec(run=run, model_class=type(model).__name__, spot_check_fraction=0.0),
        FleetAddress(env.server.url, env.settings.admin_token.get_secret_value(), REDIS_URL, env.prefix),
        BackendTuning(shard_bytes=4096, blob_dir=blob_dir))


def test_shards_written_in_the_shared_store_load_bit_exact_without_a_download(env):  # noqa: F811
    model = tiny_model()
    be = _backend(env, model, "shared", env.settings.blob_dir)
    be.publish(0)
    assert be.publisher.publish_timings[0]["local"] == 1.0 and be.publisher.blobs.note == ""
    client, _ = env.worker("w0")
    manifest = client.version("shared", 0)
    assert all(client.has_blob(s.sha256) for s in manifest.shards) and len(manifest.shards) > 3
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / "wc", metrics=metrics, shared_blob_dir=env.settings.blob_dir)
    loaded = cache.get("shared", 0)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(params_of(loaded.model), params_of(model)))
    assert metrics.weight_bytes._value.get() == 0  # nothing downloaded
    assert metrics.cache_hits.labels("shared")._value.get() == len(manifest.shards)
    be.close()


def test_a_blob_dir_the_coordinator_does_not_see_falls_back_to_http(env, tmp_path):  # noqa: F811
    model = tiny_model(seed=1)
    be = _backend(env, model, "elsewhere", tmp_path / "not-the-store")
    be.publish(0)
    assert be.publisher.publish_timings[0]["local"] == 0.0 and "not the coordinator's blob directory" in be.publisher.blobs.note
    client, _ = env.worker("w0")
    manifest = client.version("elsewhere", 0)
    assert all(client.has_blob(s.sha256) for s in manifest.shards)  # uploaded over HTTP after all
    be.close()


def test_a_corrupt_shared_copy_is_skipped_and_the_shard_downloaded(env, tmp_path):  # noqa: F811
    model = tiny_model(seed=2)
    be = _backend(env, model, "skip", None)
    be.publish(0)
    client, _ = env.worker("w0")
    manifest = client.version("skip", 0)
    shared = tmp_path / "copy"
    shutil.copytree(env.settings.blob_dir, shared)
    bad = manifest.shards[2]
    path = shared / bad.sha256[:2] / bad.sha256
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x04
    path.write_bytes(bytes(data))
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / "wc2", metrics=metrics, shared_blob_dir=shared)
    loaded = cache.get("skip", 0)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params_of(loaded.model), params_of(model)))
    assert metrics.corrupt._value.get() == 1
    assert metrics.weight_bytes._value.get() == bad.bytes  # only the corrupt one travelled
    assert metrics.cache_hits.labels("shared")._value.get() == len(manifest.shards) - 1
    be.close()


def test_a_wrong_blob_dir_is_refused_even_when_the_coordinator_already_holds_the_shards(env, tmp_path):  # noqa: F811
    """The first run uploads over HTTP; a second run of the same weights with a blob_dir that is not the
    coordinator's must not take the coordinator's copies of those shards as proof (review of issue 15)."""
    model = tiny_model(seed=3)
    first = _backend(env, model, "first", None)
    first.publish(0)
    second = _backend(env, model, "second", tmp_path / "not-the-store")
    assert second.publisher.blobs.local is None and "not the coordinator's blob directory" in second.publisher.blobs.note
    second.publish(0)
    with torch.no_grad():
        model.transformer.ln_f.weight.add_(1.0)
    second.publish(1)  # new shards go over HTTP: registration finds them
    assert second.publisher.publish_timings[1]["local"] == 0.0
    assert list((tmp_path / "not-the-store").glob("??/*")) == []  # the probe blob was removed
    first.close()
    second.close()


def test_an_unwritable_blob_dir_falls_back_to_http(env, tmp_path):  # noqa: F811
    model = tiny_model(seed=4)
    (tmp_path / "a-file").write_text("x")
    be = _backend(env, model, "unwritable", tmp_path / "a-file" / "blobs")  # mkdir under a file: OSError
    assert be.publisher.blobs.local is None and "cannot be written" in be.publisher.blobs.note
    be.publish(0)
    assert be.publisher.publish_timings[0]["local"] == 0.0
    be.close()


def test_an_empty_blob_dir_variable_means_none(monkeypatch):
    from fleet.attach import FleetSettings

    monkeypatch.setenv("SPARECYCLES_BLOB_DIR", "")
    s = FleetSettings(admin_token="t" * 16, redis_url="redis://127.0.0.1:6379/0")
    assert s.blob_dir is None
