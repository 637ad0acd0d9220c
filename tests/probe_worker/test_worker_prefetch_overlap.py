"""Issue 37, shard loading overlapped with compute: a probe worker's prefetch of a snapshot version runs while a
task holds the runtime's evaluation lock; a seed-ledger version's replay (which clones a loaded model's
parameters) still waits for it. Against a real coordinator (uvicorn in a thread, real Redis DB 12), on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from probe_kernels import replay_
from probe_worker.cache import WeightCache
from probe_worker.metrics import WorkerMetrics
from probe_worker.runtime import ProbeRuntime
from support.worker_env import params_of, tiny_model, worker_env


@pytest.fixture
def env(tmp_path):
    yield from worker_env(tmp_path)


class _WatchedLock:
    """A real lock that says when a thread had to wait for it (`contended`): how the test knows the prefetch is
    blocked on the evaluation lock without timing anything."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> _WatchedLock:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def _runtime(env, run: str, model):
    be = env.backend(model, run)
    be.publish(0)
    client, wid = env.worker("w0")
    metrics = WorkerMetrics(CollectorRegistry())
    cache = WeightCache(client, env.tmp / "wc", metrics=metrics)
    cache.get(run, 0)  # the version tasks evaluate now
    return be, cache, ProbeRuntime(client, wid, cache, metrics), metrics


def _prefetch_in_thread(runtime: ProbeRuntime, run: str, version: int):
    done, errors = threading.Event(), []

    def body() -> None:
        try:
            runtime.prefetch(run, version)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=body, name="test-prefetch", daemon=True).start()
    return done, errors


def _same(a, b) -> bool:
    return all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(params_of(a), params_of(b)))


def test_snapshot_prefetch_completes_while_an_evaluation_holds_the_lock(env):
    model = tiny_model(seed=3)
    be, cache, runtime, metrics = _runtime(env, "overlap", model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    be.publish(1)
    with runtime._lock:  # a task evaluating: before issue 37 the prefetch waited for its end
        done, errors = _prefetch_in_thread(runtime, "overlap", 1)
        assert done.wait(timeout=60), "the snapshot prefetch was serialized behind the evaluation"
        assert errors == []
        assert cache.has("overlap", 1) and runtime.current_version == 1
    loaded = cache.get("overlap", 1)
    assert _same(loaded.model, model)  # the published weights, bit for bit
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    assert metrics.version._value.get() == 1
    be.close()


def test_ledger_prefetch_waits_for_the_evaluation_lock(env):
    model = tiny_model(seed=4)
    be, cache, runtime, metrics = _runtime(env, "ledger-wait", model)
    seeds, coeffs = [31, 32], [2e-3, -1e-3]
    with torch.no_grad():
        offset = 0
        for _, p in model.named_parameters():
            replay_(p.data, seeds, coeffs, offset, "rademacher")
            offset += p.numel()
    be.publish_ledger(1, seeds, coeffs, "rademacher")
    runtime._lock = lock = _WatchedLock()
    v0 = cache.get("ledger-wait", 0).model
    with lock:  # a task evaluating, mid-probe: v0's parameters hold perturbed values
        clean = [p.detach().clone() for p in v0.parameters()]
        with torch.no_grad():
            for p in v0.parameters():
                p.add_(1.0)
        done, errors = _prefetch_in_thread(runtime, "ledger-wait", 1)
        assert lock.contended.wait(timeout=60), "the ledger prefetch never reached the evaluation lock"
        assert not done.is_set() and not cache.has("ledger-wait", 1)  # it waits: no replay from perturbed weights
        with torch.no_grad():
            for p, c in zip(v0.parameters(), clean):
                p.copy_(c)
    assert done.wait(timeout=60) and errors == []
    assert _same(cache.get("ledger-wait", 1).model, model)
    assert runtime.current_version == 1 and metrics.replayed._value.get() == 1
    be.close()


def test_two_threads_asking_for_one_version_load_it_once(env):
    model = tiny_model(seed=5)
    be, cache, _, metrics = _runtime(env, "once", model)
    with torch.no_grad():
        model.transformer.ln_f.weight.add_(1.0)
    be.publish(1)
    misses = metrics.cache_misses.labels("version")._value.get()
    start, got = threading.Barrier(2), []

    def ask() -> None:
        start.wait(timeout=60)
        got.append(cache.get("once", 1))

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # whichever came second found it loaded or waited for the first one's load: one load, one model
    assert len(got) == 2 and got[0] is got[1]
    assert metrics.cache_misses.labels("version")._value.get() - misses == 1
    assert _same(got[0].model, model)
    be.close()
