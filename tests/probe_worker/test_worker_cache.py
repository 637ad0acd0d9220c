"""Probe-worker components against a real coordinator (uvicorn in a thread, real Redis DB 12): shard
publishing and loading, corruption handling, task validation, the probe runtime, the batch codec, the
canary digest, and trainer-restart delivery through CoordinatorBackend."""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis
import torch
from celery.exceptions import Reject
from prometheus_client import CollectorRegistry

from coordinator.client import CoordinatorClient, CorruptBlobError
from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from fleet.publisher import write_shards
from probe_kernels import ProbeEvaluator
from probe_kernels.reference import direction_ref
from probe_worker.cache import WeightCache
from probe_worker.metrics import WorkerMetrics
from probe_worker.runtime import ProbeRuntime
from probe_worker.task_checks import canary_digest
from probe_worker.tasks import DrainState, run_probe
from support.worker_env import REDIS_URL, make_batch, params_of, tiny_model, worker_env
from trainer.train import lm_loss
from trainer.zo.probes import RoundSpec
from wire.batch import decode_batch, encode_batch
from wire.messages import CanarySpec
from wire.round_messages import ProbeTask


@pytest.fixture
def env(tmp_path):
    yield from worker_env(tmp_path)


def _worker_cache(env, name: str) -> tuple[CoordinatorClient, str, WorkerMetrics, WeightCache]:
    """Worker `name` enrolled at `env`'s coordinator: its client, id, metrics and a weight cache in env.tmp/wc."""
    client, wid = env.worker(name)
    metrics = WorkerMetrics(CollectorRegistry())
    return client, wid, metrics, WeightCache(client, env.tmp / "wc", metrics=metrics)


def test_published_version_loads_bit_exact_and_fetches_only_new_shards(env):
    model = tiny_model()
    be = env.backend(model, "shards")
    be.publish(0)
    client, _, metrics, cache = _worker_cache(env, "w0")
    loaded = cache.get("shards", 0)
    n_shards = len(loaded.manifest.shards)
    assert n_shards == len(write_shards(model, 4096)) > 3  # 4 KiB shards: the tiny model spans many
    got, want = params_of(loaded.model), params_of(model)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, want))
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight  # tie survives
    bytes_v0 = metrics.weight_bytes._value.get()
    assert bytes_v0 == sum(s.bytes for s in loaded.manifest.shards)

    with torch.no_grad():
        model.transformer.ln_f.weight.add_(1.0)  # one small tensor changes -> one shard changes
    be.publish(1)
    v1 = cache.get("shards", 1)
    changed = {s.sha256 for s in v1.manifest.shards} - {s.sha256 for s in loaded.manifest.shards}
    assert len(changed) == 1
    assert metrics.weight_bytes._value.get() - bytes_v0 == sum(s.bytes for s in v1.manifest.shards
                                                               if s.sha256 in changed)
    assert metrics.cache_hits.labels("shard")._value.get() == n_shards - 1
    assert torch.equal(v1.model.transformer.ln_f.weight, model.transformer.ln_f.weight)
    assert cache.get("shards", 1) is v1 and metrics.cache_hits.labels("version")._value.get() == 1
    assert metrics.version._value.get() == 1
    be.close()


def _flip_bit(path, byte: int, bit: int) -> None:
    """Corrupt the file at `path`: flip bit `bit` of byte `byte` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[byte] ^= 1 << bit
    path.write_bytes(bytes(data))


def _published(env, run: str):
    """(model, backend, worker client, manifest) of version 0 of a tiny model published as `run`."""
    model = tiny_model()
    be = env.backend(model, run)
    be.publish(0)
    client, _ = env.worker("w0")
    return model, be, client, client.version(run, 0)


def test_corrupt_cached_shard_is_deleted_and_refetched(env):
    model, be, client, manifest = _published(env, "corrupt-cache")
    WeightCache(client, env.tmp / "wc", metrics=WorkerMetrics(CollectorRegistry())).get("corrupt-cache", 0)
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / "wc", metrics=metrics)  # a restarted worker: disk cache only
    path = cache.shard_path(manifest.shards[0].sha256)
    _flip_bit(path, -1, 0)  # one bit in the tensor data
    loaded = cache.get("corrupt-cache", 0)
    assert metrics.corrupt._value.get() == 1
    assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest.shards[0].sha256
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params_of(loaded.model), params_of(model)))
    be.close()


def test_corrupt_blob_from_coordinator_is_never_loaded(env):
    _, be, client, manifest = _published(env, "corrupt-blob")
    blob = env.settings.blob_dir / manifest.shards[1].sha256[:2] / manifest.shards[1].sha256
    _flip_bit(blob, blob.stat().st_size // 2, 7)
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / "wc", metrics=metrics)
    with pytest.raises(CorruptBlobError):
        cache.get("corrupt-blob", 0)
    assert metrics.corrupt._value.get() == 3  # every try arrived corrupt
    assert not cache.shard_path(manifest.shards[1].sha256).exists()
    assert list(cache.shard_dir.glob("??/.part-*")) == []
    be.close()


def test_runtime_posts_evaluator_values_once_and_rejects_bad_tasks(env):
    model = tiny_model(seed=5)
    be = env.backend(model, "runtime", distribution="gauss8")
    be.publish(0)
    batch = make_batch(1)
    be.submit(RoundSpec("rt-0", 0, batch, eps=1e-3, seeds=(7, 8, 9), distribution="gauss8", want_clean=True))
    client, wid = env.worker("w0")
    metrics = WorkerMetrics(CollectorRegistry())
    runtime = ProbeRuntime(client, wid, WeightCache(client, env.tmp / "wc", metrics=metrics), metrics)
    drain = DrainState()
    kwargs = ProbeTask(run="runtime", round_id="rt-0", version=0, batch_sha256=be.publisher.blobs.upload(encode_batch(batch)),
                       eps=1e-3, distribution="gauss8", seeds=[7, 8, 9], want_clean=True).model_dump(mode="json")
    assert run_probe(runtime, drain, metrics, kwargs) == "done"
    assert run_probe(runtime, drain, metrics, kwargs) == "done"  # a redelivery: identical values, deduped
    assert metrics.results.labels("accepted")._value.get() == 3
    assert metrics.results.labels("duplicate")._value.get() == 3
    assert metrics.clean._value.get() == 1 and metrics.cache_hits.labels("clean")._value.get() == 1
    got = be.collect("rt-0")
    res = {r.seed: r for r in got.results}
    assert (got.counts["accepted"], got.counts["duplicate"]) == (3, 0)  # intake's counts only when asked for
    # the trainer's counts are the coordinator's intake counts (RoundInfo), not a second judgement
    got = be.collect(counts=True)
    assert (got.counts["accepted"], got.counts["duplicate"], got.counts["stale"]) == (0, 3, 0)
    assert be.collect(counts=True).counts["duplicate"] == 0  # reported once
    ev = ProbeEvaluator(model, lambda m, b: lm_loss(m, b[0], b[1]))
    for s in (7, 8, 9):
        assert res[s].l_plus == ev.loss(batch, s, 1e-3, "gauss8")
        assert res[s].l_minus == ev.loss(batch, s, -1e-3, "gauss8")
        assert res[s].l0 == ev.clean_loss(batch)
    for bad in ({"run": "runtime"}, {**kwargs, "eps": -1.0}, {**kwargs, "seeds": [-1]}, {**kwargs, "x": 1},
                {**kwargs, "version": "0"}, ["not", "an", "object"]):
        with pytest.raises(Reject) as exc:
            run_probe(runtime, drain, metrics, bad)
        assert exc.value.requeue is False
    assert metrics.tasks.labels("invalid")._value.get() == 6
    drain.set_operator_drain(True)
    with pytest.raises(Reject) as exc:
        run_probe(runtime, drain, metrics, kwargs)
    assert exc.value.requeue is True and metrics.tasks.labels("requeued")._value.get() == 1
    drain.set_operator_drain(False)
    drain.set_engine_busy(True)  # only the serving engine holds the worker back: the delivered task waits for it, then runs
    threading.Timer(0.3, drain.set_engine_busy, args=(False,)).start()
    assert run_probe(runtime, drain, metrics, kwargs) == "done" and not drain.engine_busy
    assert metrics.tasks.labels("requeued")._value.get() == 1  # held, not handed back
    unknown = {**kwargs, "version": 9}
    drain.set_operator_drain(False)
    assert run_probe(runtime, drain, metrics, unknown) == "refused"  # 404: no such version
    be.close()


def test_canary_attestation_counts_results(env):
    seed, numel = 12345, 1000
    z = direction_ref(seed, 0, numel, "gauss8").numpy().astype("<f4").tobytes()
    digest = hashlib.sha256(z).hexdigest()
    assert canary_digest(seed, numel, "gauss8") == digest
    model = tiny_model()
    be = env.backend(model, "canary", canary=CanarySpec(seed=seed, numel=numel, distribution="gauss8",
                                                        digest=digest))
    be.publish(0)
    batch = make_batch(2)
    be.submit(RoundSpec("c-0", 0, batch, eps=1e-3, seeds=(1, 2), distribution="gauss8"))
    client, wid = env.worker("w0")
    metrics = WorkerMetrics(CollectorRegistry())
    runtime = ProbeRuntime(client, wid, WeightCache(client, env.tmp / "wc", metrics=metrics), metrics)
    task = ProbeTask(run="canary", round_id="c-0", version=0, batch_sha256=be.publisher.blobs.upload(encode_batch(batch)),
                     eps=1e-3, distribution="gauss8", seeds=[1, 2], want_clean=False)
    assert runtime.run_task(task).outcomes == ["accepted", "accepted"]
    be.close()


def test_trainer_restart_receives_undelivered_results(env):
    model = tiny_model()
    be = env.backend(model, "restart")
    be.publish(0)
    batch = make_batch(3)
    be.submit(RoundSpec("rs-0", 0, batch, eps=1e-3, seeds=(1, 2, 3, 4), distribution="rademacher"))
    client, wid = env.worker("w0")
    runtime = ProbeRuntime(client, wid, WeightCache(client, env.tmp / "wc"), WorkerMetrics(CollectorRegistry()))
    sha = hashlib.sha256(encode_batch(batch)).hexdigest()
    for seeds in ([1, 2], [3, 4]):
        runtime.run_task(ProbeTask(run="restart", round_id="rs-0", version=0, batch_sha256=sha, eps=1e-3,
                                   distribution="rademacher", seeds=seeds, want_clean=False))
    be.results.drain(block_ms=1)  # read into memory, never handed out: then the trainer "crashes"
    assert len(be.results.buffered) == 4
    be.close()
    be2 = CoordinatorBackend.connect(model, "restart", FleetAddress(
        env.server.url, env.settings.admin_token.get_secret_value(), REDIS_URL, env.prefix))
    got = be2.collect().results
    assert sorted(r.seed for r in got) == [1, 2, 3, 4] and be2.results.reader.pending() == 0
    assert be2.collect().results == []
    be2.close()


def test_batch_codec_roundtrip_and_errors():
    x, y = make_batch(4)
    data = encode_batch((x, y))
    assert data == encode_batch((x.clone(), y.clone()))  # deterministic bytes -> stable content hash
    x2, y2 = decode_batch(data)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(TypeError):
        encode_batch((x.float(), y))
    with pytest.raises(ValueError):
        encode_batch((x, y[:, :3]))
    with pytest.raises(ValueError):
        decode_batch(b"not safetensors")


def _celery_kwargs(queue: str) -> list[dict]:
    """Pop every probe task the coordinator published on `queue` (kombu Redis list) and decode its kwargs."""
    import base64
    import json

    r = redis.Redis.from_url(REDIS_URL)
    out = []
    while (raw := r.rpop(queue)) is not None:
        msg = json.loads(raw)
        assert msg["headers"]["task"] == "sparecycles.probe" and msg["content-type"] == "application/json"
        _, kwargs, _ = json.loads(base64.b64decode(msg["body"]))
        out.append(kwargs)
    return out


def test_block_scaled_along_update_and_group_match_in_process(env):
    """Tasks taken off the real Celery queue, evaluated by the worker runtime, give bit-identical L+, L-, L0
    (and the trainer-side scale) to InProcessBackend for block-scaled, along-update and group rounds."""
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.probes import ProbeKind

    model = tiny_model(seed=6)
    be = env.backend(model, "kinds", seeds_per_task=2)
    ref = InProcessBackend(model, lambda m, b: lm_loss(m, b[0], b[1]), history=2)
    be.publish(0)
    ref.publish(0)
    with torch.no_grad():  # move three blocks; the others stay put (their along-update probe is flat)
        model.transformer.wte.weight.mul_(1.01)
        model.transformer.h[0].attn.c_attn.weight.add_(1e-3)
        model.transformer.ln_f.bias.add_(0.05)
    be.publish(1)
    ref.publish(1)
    n_blocks = len(list(model.named_parameters()))
    batch = make_batch(7)
    rounds = [
        RoundSpec("k-bs", 1, batch, eps=1e-2, seeds=(11, 12, 13), want_clean=True, kind=ProbeKind.BLOCK_SCALED),
        RoundSpec("k-au", 1, batch, eps=1e-2, seeds=(0, 1, 2, n_blocks - 1), want_clean=True,
                   kind=ProbeKind.ALONG_UPDATE, base_version=0),
        RoundSpec("k-g", 1, batch, eps=1e-2, seeds=(21, 22), distribution="gauss8", want_clean=True, kind=ProbeKind.GROUP,
                  blocks=(0, 3, n_blocks - 1)),
    ]
    client, wid = env.worker("w0")
    metrics = WorkerMetrics(CollectorRegistry())
    runtime = ProbeRuntime(client, wid, WeightCache(client, env.tmp / "wc", metrics=metrics), metrics)
    seen = {}
    for rnd in rounds:
        be.submit(rnd)
        for kwargs in _celery_kwargs(f"{env.prefix}.probe.kinds"):
            assert run_probe(runtime, DrainState(), metrics, kwargs) == "done"
        got = {r.seed: r for r in be.collect(rnd.round_id).results}
        ref.submit(rnd)
        want = {r.seed: r for r in ref.collect(rnd.round_id).results}
        assert set(got) == set(rnd.seeds) == set(want)
        for s in rnd.seeds:
            g, w = got[s], want[s]
            assert (g.l_plus, g.l_minus, g.l0, g.scale) == (w.l_plus, w.l_minus, w.l0, w.scale)
        seen[rnd.round_id] = got, want
    assert all(r.l_plus != r.l_minus for r in seen["k-g"][0].values())
    got, want = seen["k-au"]
    flat = [got[s] for s in (1, 2) if want[s].scale == 0.0]
    assert flat and all(r.l_plus == r.l_minus == r.l0 for r in flat)  # unmoved blocks probe flat
    assert got[0].scale > 0 and got[0].l_plus != got[0].l_minus
    be.close()


def _ledger_run(env, seed: int, run: str, worker: str, folder: str) -> tuple:
    """A tiny model published as `run` version 0, and a worker `worker` whose WeightCache (in env.tmp/`folder`, its
    own metrics) has loaded it. Returns (model, backend, client, worker id, metrics, cache)."""
    model = tiny_model(seed=seed)
    be = env.backend(model, run)
    be.publish(0)
    client, wid = env.worker(worker)
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / folder, metrics=metrics)
    cache.get(run, 0)
    return model, be, client, wid, metrics, cache


@torch.no_grad()
def _step_and_publish(model, be, version: int, seeds: list[int], coeffs: list[float], dist: str,
                      scale: float) -> None:
    """One pure-ZO step on `model` as the trainer takes it (decay by `scale`, then the seeds' replay over the flat
    parameter offsets), published as seed-ledger entry `version`."""
    from probe_kernels import replay_

    offset = 0
    for _, p in model.named_parameters():
        if scale != 1.0:
            p.data.mul_(scale)
        replay_(p.data, seeds, coeffs, offset, dist)
        offset += p.numel()
    be.publish_ledger(version, seeds, coeffs, dist, scale)


def test_seed_ledger_versions_replay_bit_exact(env):
    """Pure-ZO versions published as seed-ledger entries are rebuilt on the worker by replay (from the loaded
    parent, or from the snapshot when nothing is loaded) with weights and losses bit-identical to the trainer's."""

    model, be, client, wid, metrics, cache = _ledger_run(env, 8, "ledger", "w0", "wc")
    steps = [([11, 12, 13], [1e-3, -2e-3, 5e-4], "rademacher", 1.0), ([21, 22], [-1e-3, 3e-3], "gauss8", 0.999)]
    for v, (seeds, coeffs, dist, scale) in enumerate(steps, start=1):
        _step_and_publish(model, be, v, seeds, coeffs, dist, scale)
    v2 = cache.get("ledger", 2)  # replays entry 1 (onto loaded v0), then entry 2
    fresh = WeightCache(client, env.tmp / "wc2", metrics=WorkerMetrics(CollectorRegistry())).get("ledger", 2)
    for loaded in (v2, fresh):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params_of(loaded.model), params_of(model)))
    assert metrics.replayed._value.get() == 2
    v0 = cache.get("ledger", 0)
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(params_of(v2.model), params_of(v0.model)))
    batch = make_batch(9)
    be.submit(RoundSpec("l-0", 2, batch, eps=1e-3, seeds=(5, 6), distribution="rademacher", want_clean=True))
    runtime = ProbeRuntime(client, wid, cache, metrics)
    for kwargs in _celery_kwargs(f"{env.prefix}.probe.ledger"):
        assert run_probe(runtime, DrainState(), metrics, kwargs) == "done"
    ev = ProbeEvaluator(model, lambda m, b: lm_loss(m, b[0], b[1]))
    got = be.collect("l-0").results
    assert sorted(r.seed for r in got) == [5, 6]
    for r in got:
        assert (r.l_plus, r.l_minus, r.l0) == (ev.loss(batch, r.seed, 1e-3, "rademacher"),
                                               ev.loss(batch, r.seed, -1e-3, "rademacher"), ev.clean_loss(batch))
    be.close()


def test_zo_training_through_coordinator_matches_in_process(env):
    """CoordinatorBackend is a drop-in for InProcessBackend: two 1.5-SPSA steps whose probes are evaluated by
    a worker runtime consuming the real Celery queue (in a thread) leave weights and logged scalars
    bit-identical to the same steps in process (the first round publishes a snapshot; each step then publishes
    its update as a seed-ledger entry, which the worker replays)."""
    import threading

    from trainer.zo.backend import InProcessBackend
    from trainer.zo.zo_step import ZOStepper

    m_fleet, m_ref = tiny_model(seed=9), tiny_model(seed=9)
    be = env.backend(m_fleet, "zo", seeds_per_task=2)
    ref = InProcessBackend(m_ref, lambda m, b: lm_loss(m, b[0], b[1]))
    client, wid = env.worker("w0")
    metrics = WorkerMetrics(CollectorRegistry())
    runtime = ProbeRuntime(client, wid, WeightCache(client, env.tmp / "wc", metrics=metrics), metrics)
    stop = threading.Event()

    def consume() -> None:
        r = redis.Redis.from_url(REDIS_URL)
        while not stop.is_set():
            if r.llen(f"{env.prefix}.probe.zo"):
                for kwargs in _celery_kwargs(f"{env.prefix}.probe.zo"):
                    run_probe(runtime, DrainState(), metrics, kwargs)
            stop.wait(0.02)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    try:
        st_f = ZOStepper(m_fleet, "1.5spsa", run_seed=3, probes=4, eps=1e-3)
        st_r = ZOStepper(m_ref, "1.5spsa", run_seed=3, probes=4, eps=1e-3)
        for step in range(2):
            batch = make_batch(20 + step)
            assert st_f.step(step, batch, be, lr=1e-2) == st_r.step(step, batch, ref, lr=1e-2)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert be.published == [0, 1, 2] and be.forward_passes == 2 * (2 * 4 + 1)
    assert client.versions("zo") == [0]  # versions 1 and 2 travelled as seed-ledger entries, replayed by the worker
    assert metrics.replayed._value.get() == 1  # v1 onto v0 (the last entry, v2, is never probed)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params_of(m_fleet), params_of(m_ref)))
    assert not torch.equal(params_of(m_fleet)[0][1], params_of(tiny_model(seed=9))[0][1])  # training moved theta
    be.close()


def test_background_publish_uploads_the_weights_of_the_publish_call_and_raises_upload_errors_later(env):
    model = tiny_model()
    be = env.backend(model, "bg")
    bg = CoordinatorBackend.connect(model, "bg", FleetAddress(env.server.url, env.settings.admin_token.get_secret_value(),
                                                              REDIS_URL, env.prefix),
                                    BackendTuning(shard_bytes=4096, background=True, max_pending=1, consumer="bg"))
    be.publish(0)  # the synchronous reference: same weights, same shards
    want = {0: params_of(model)}
    with torch.no_grad():
        for v in (1, 2, 3):  # the model moves right after each call, as the next training step would move it
            bg.publish(v)
            want[v] = params_of(model)
            for p in model.parameters():
                p.mul_(1.01)
    bg.flush()
    client, _ = env.worker("w0")
    cache = WeightCache(client, env.tmp / "wc", keep_versions=4, keep_disk_versions=4)
    # v1 holds v0's weights: the background path writes the synchronous path's bytes
    assert [s.sha256 for s in cache.get("bg", 1).manifest.shards] == [s.sha256 for s in client.version("bg", 0).shards]
    for v in (0, 1, 2, 3):
        got = params_of(cache.get("bg", v).model)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want[v])), v
    assert client.version("bg", 2).parent == 1 and len(bg.publisher.publish_seconds) == 3
    assert sorted(bg.publisher.publish_timings) == [1, 2, 3] and sorted(be.publisher.publish_timings) == [0]
    assert {t["bytes"] for t in bg.publisher.publish_timings.values()} == {sum(s.bytes for s in client.version("bg", 0).shards)}

    tried, queued = [], threading.Event()

    def refuse(sha, *args):
        tried.append(sha)
        queued.wait(30)  # fail only once version 5 is queued behind this upload
        raise RuntimeError("upload refused")

    bg.client.put_blob = refuse
    bg.publish(4)  # returns; the upload fails on the background thread
    bg.publish(5, _blocks(bg))  # queued behind 4 (a caller's copy: no host buffer to wait for)
    queued.set()
    with pytest.raises(RuntimeError, match="upload refused"):
        bg.flush()
    with pytest.raises(RuntimeError, match="not sent: an earlier background upload failed"):
        bg.flush()  # version 5 was never tried: it would have followed a version that is not registered
    # version 4's changed shards, each once (in parallel); version 5 (the same weights) would repeat them
    assert 0 < len(tried) == len(set(tried)) <= len(write_shards(bg.publisher.model, bg.publisher.shard_bytes))
    bg.close()
    be.close()


def _blocks(backend) -> list[torch.Tensor]:
    """A copy of the backend's canonical blocks (as a training step's pinned copy would be)."""
    return [b.param.detach().clone() for b in backend.blocks]


def test_an_interrupted_replay_keeps_the_entries_it_finished(env):
    """A serving worker's replay stopped between entries (WeightCache.interrupt raising, as while it yields) keeps the
    entries it finished as their version, bit-identical to the trainer's, and the next replay goes on from there."""
    from probe_worker.preemption import Preempted

    model, be, _, _, metrics, cache = _ledger_run(env, 9, "partial", "w1", "wp")
    states = []
    for v, seeds in enumerate(([31, 32], [41], [51, 52]), start=1):
        _step_and_publish(model, be, v, seeds, [1e-3] * len(seeds), "rademacher", 1.0)
        states.append([p.detach().clone() for _, p in params_of(model)])
    calls = []

    def interrupt() -> None:  # before entry 1 passes, before entry 2 stops the replay
        calls.append(1)
        if len(calls) == 2:
            raise Preempted("the serving engine needs the device")

    cache.interrupt = interrupt
    with pytest.raises(Preempted):
        cache.get("partial", 3)
    assert metrics.replayed._value.get() == 1
    cache.interrupt = lambda: None
    v1 = cache.get("partial", 1)  # kept by the stopped replay: nothing replayed now
    assert metrics.replayed._value.get() == 1
    assert all(torch.equal(a, b) for (_, a), b in zip(params_of(v1.model), states[0]))
    v3 = cache.get("partial", 3)  # on from version 1: two entries
    assert metrics.replayed._value.get() == 3
    assert all(torch.equal(a, b) for (_, a), b in zip(params_of(v3.model), states[2]))
    be.close()


def test_a_replay_cut_inside_an_entry_puts_it_back_and_keeps_the_entries_before(env):
    """A serving worker's replay cut inside an entry (a chunk hook of the CPU path raising, as when the engine fires
    the task) puts that entry's tensors back (WeightCache.interruptible) and keeps the entries before it, bit-identical
    to the trainer's; the next replay goes on from there."""
    from probe_kernels import replay_
    from probe_kernels.reference import add_chunk_hook
    from probe_worker.preemption import Preempted

    model = tiny_model(seed=9)
    be = env.backend(model, "cut")
    be.publish(0)
    client, _, metrics, cache = _worker_cache(env, "w1")
    cache.get("cut", 0)
    states = []
    with torch.no_grad():
        for v, seeds in enumerate(([31, 32], [41, 42, 43]), start=1):
            offset = 0
            for _, p in model.named_parameters():
                replay_(p.data, seeds, [1e-3] * len(seeds), offset, "gauss8")
                offset += p.numel()
            be.publish_ledger(v, seeds, [1e-3] * len(seeds), "gauss8", 1.0)
            states.append([p.detach().clone() for _, p in params_of(model)])
    entries, chunks = [], []

    def interrupt() -> None:
        entries.append(1)

    def chunk() -> None:  # the 4th chunk of entry 2: some of its tensors are already changed
        if len(entries) == 2:
            chunks.append(1)
            if len(chunks) == 4:
                raise Preempted("the serving engine needs the device")

    cache.interrupt, cache.interruptible = interrupt, True
    remove = add_chunk_hook(chunk)
    try:
        with pytest.raises(Preempted):
            cache.get("cut", 2)
    finally:
        remove()
    assert metrics.replayed._value.get() == 1
    v1 = cache.get("cut", 1)  # kept, with entry 2's changes put back
    assert all(torch.equal(a, b) for (_, a), b in zip(params_of(v1.model), states[0]))
    v2 = cache.get("cut", 2)
    assert metrics.replayed._value.get() == 2
    assert all(torch.equal(a, b) for (_, a), b in zip(params_of(v2.model), states[1]))
    be.close()


def test_a_snapshot_load_stops_between_shards_once_the_worker_stops(env):
    """A worker stopping while it loads a snapshot (its warm shutdown began: WeightCache.stopping) starts no further
    shard: the load raises LoadStopped after the shards already being read (here the first one: every later shard
    sees the stop before it is read), keeps no version, and a probe task whose load stopped goes back to its queue.
    Once loading again, the version loads whole and bit-exact, reading only the shards it lacks."""
    from probe_worker.cache import LoadStopped
    from probe_worker.tasks import HandBack

    model = tiny_model(seed=6)
    be = env.backend(model, "stopping")
    be.publish(0)
    client, wid, metrics, cache = _worker_cache(env, "w0")
    checks = []
    cache.stopping = lambda: bool(checks.append(1)) or len(checks) > 1  # the stop comes after the first shard began
    with pytest.raises(LoadStopped):
        cache.get("stopping", 0)
    shards = client.version("stopping", 0).shards
    assert len(shards) > 3 and metrics.cache_misses.labels("shard")._value.get() == 1  # one shard read of many
    assert metrics.weight_bytes._value.get() in {s.bytes for s in shards} and not cache.has("stopping", 0)

    runtime = ProbeRuntime(client, wid, cache, metrics)
    batch = make_batch(1)
    kwargs = ProbeTask(run="stopping", round_id="st-0", version=0, eps=1e-3, distribution="rademacher", seeds=[1],
                       want_clean=False,
                       batch_sha256=be.publisher.blobs.upload(encode_batch(batch))).model_dump(mode="json")
    be.submit(RoundSpec("st-0", 0, batch, eps=1e-3, seeds=(1,), distribution="rademacher"))
    with pytest.raises(HandBack) as exc:
        run_probe(runtime, DrainState(), metrics, kwargs)
    assert exc.value.requeue is True and "not taking tasks (shutting_down" in exc.value.reason
    assert metrics.tasks.labels("requeued")._value.get() == 1 and not cache.has("stopping", 0)

    cache.stopping = lambda: False
    loaded = cache.get("stopping", 0)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params_of(loaded.model), params_of(model)))
    assert metrics.cache_hits.labels("shard")._value.get() == 1  # the shard read before the stop, from disk
    assert metrics.cache_misses.labels("shard")._value.get() == len(shards)
    assert run_probe(runtime, DrainState(), metrics, kwargs) == "done"
    be.close()
