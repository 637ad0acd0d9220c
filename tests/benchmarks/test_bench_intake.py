"""The intake bench runs end to end on real Redis (small sizes; no timing is asserted)."""

from __future__ import annotations

import secrets

import redis

from benchmarks.intake import run_intake_bench


def test_bench_intake_store_and_http_accept_everything_exactly_once(redis_url):
    r = redis.Redis.from_url(redis_url)
    prefix = "tbench" + secrets.token_hex(4)
    for mode in ("store", "http"):
        res = run_intake_bench(
            mode, workers=8, n_results=600, batch=4, redis_url=redis_url, key_prefix=prefix
        )
        assert res.accepted == res.streamed == res.results == 600
        assert 0 < res.p50_ms <= res.p99_ms and res.results_per_s > 0 and res.server_cpu_s > 0
    leftovers = list(r.scan_iter(f"*{prefix}*"))
    assert leftovers == []  # the bench deletes its state, queues and kombu bindings


def test_bench_intake_with_two_coordinator_processes(redis_url):
    res = run_intake_bench("http", workers=8, n_results=400, batch=4, redis_url=redis_url, coordinators=2)
    assert res.coordinators == 2
    assert res.accepted == res.streamed == res.results == 400
    assert res.server_cpu_s > 0  # summed over the coordinator's processes
