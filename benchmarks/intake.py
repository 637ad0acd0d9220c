"""`sparecycles bench intake`: result intake throughput and latency, end to end through Redis.

Two modes, both with real Redis and the real intake code (Lua dedupe + XADD to the run's stream):
- `http`: the coordinator runs as a separate process (`--coordinators C`: C uvicorn processes sharing the
  port, as `sparecycles coordinator --workers C`); N simulated workers (registered over REST,
  each with its own token and keep-alive connection, asyncio + a lean HTTP/1.1 client) post result batches, one batch
  per task as real workers do. Latency = worker starts the POST -> reply received (the result is on the
  stream by then); it excludes compute by construction.
- `store`: N threads call `Intake.submit` in-process (no HTTP), isolating the Redis/Lua cost.
Afterwards the stream length is checked against the number of accepted results.
The simulated workers' client and loop live in benchmarks.intake_load.
"""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import redis

from benchmarks.intake_load import loop_factory, post_results
from coordinator.intake import Intake
from coordinator.metrics import CoordinatorMetrics
from coordinator.settings import CoordinatorSettings, generate_dev_settings
from coordinator.store import Store, results_stream_key
from wire.messages import RunSpec, ShardRef, VersionManifest, WorkerRegistration
from wire.round_messages import ProbeResult, ProbeRound

RUN = "bench"


@dataclass
class IntakeBenchResult:
    """Throughput in results/s; latencies in milliseconds (per result = its request's latency)."""

    mode: str
    rate: float  # offered results/s (open loop); 0 = closed loop
    workers: int
    batch: int
    results: int
    accepted: int
    streamed: int
    seconds: float
    results_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float  # CPU seconds of the coordinator (the bench process itself in `store` mode)
    client_cpu_s: float  # CPU seconds of the simulated workers (0 in `store` mode: same process)
    redis_cpu_s: float  # CPU seconds of the Redis server during the run (includes other clients' load)
    load_avg_1m: float  # machine load when the run started: other processes compete for the cores
    coordinators: int = 1  # coordinator processes (uvicorn workers) in `http` mode


def _quantile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


def _setup_rounds(store: Store, n_results: int) -> list[tuple[str, list[int]]]:
    """Create the run, version 0, a batch blob and enough rounds for `n_results` seeds (not timed)."""
    store.runs.create_run(
        RunSpec(
            run=RUN, model_class="GPT2LMHeadModel", spot_check_fraction=0.0, seeds_per_task=256, staleness=4
        )
    )
    shard, size = store.blobs.put(b"bench weights")
    store.runs.register_version(
        VersionManifest(
            run=RUN,
            version=0,
            shards=[ShardRef(name="m.safetensors", sha256=shard, bytes=size)],
            param_order_hash="0" * 64,
            dtype="float32",
            model_class="GPT2LMHeadModel",
        )
    )
    batch, _ = store.blobs.put(b"bench batch")
    rounds, seed, k = [], 1, 0
    while seed <= n_results:
        seeds = list(range(seed, min(n_results, seed + 65_535) + 1))
        rid = f"round-{k}"
        store.rounds.create_round(
            ProbeRound(
                run=RUN,
                round_id=rid,
                version=0,
                batch_sha256=batch,
                eps=1e-3,
                distribution="rademacher",
                seeds=seeds,
            )
        )
        rounds.append((rid, seeds))
        seed, k = seed + len(seeds), k + 1
    return rounds


def _batches(rounds: list[tuple[str, list[int]]], batch: int) -> list[tuple[str, list[int]]]:
    return [(rid, seeds[i : i + batch]) for rid, seeds in rounds for i in range(0, len(seeds), batch)]


def _cleanup(settings: CoordinatorSettings) -> None:
    r = redis.Redis.from_url(settings.redis_url)
    for pattern in (
        f"{settings.key_prefix}:*",
        f"{settings.queue_prefix}.*",
        f"_kombu.binding*.{settings.queue_prefix}*",
    ):
        keys = list(r.scan_iter(pattern, count=1000))
        for i in range(0, len(keys), 1000):
            r.delete(*keys[i : i + 1000])


def _redis_cpu(url: str) -> float:
    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc; empty if it has exited)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (the coordinator's uvicorn workers)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            total += _proc_cpu(p) if p == pid else _tree_cpu(p)
        except OSError:
            pass
    return total


def _finish(settings, mode, workers, batch, n, accepted, seconds, lat_ms, cpu) -> IntakeBenchResult:
    streamed = redis.Redis.from_url(settings.redis_url).xlen(results_stream_key(settings.key_prefix, RUN))
    lat_ms.sort()
    return IntakeBenchResult(
        mode,
        0.0,
        workers,
        batch,
        n,
        accepted,
        streamed,
        round(seconds, 3),
        round(accepted / seconds, 1),
        round(_quantile(lat_ms, 0.50), 3),
        round(_quantile(lat_ms, 0.99), 3),
        *(round(c, 3) for c in cpu),
        round(os.getloadavg()[0], 2),
    )


def bench_store(settings: CoordinatorSettings, workers: int, n_results: int, batch: int) -> IntakeBenchResult:
    """In-process intake from `workers` threads (no HTTP)."""
    store = Store(settings)
    intake = Intake(store, CoordinatorMetrics())
    rounds = _setup_rounds(store, n_results)
    wids = [store.workers.register_worker(WorkerRegistration(name=f"sim{i}")).worker_id for i in range(workers)]
    jobs = [
        [
            ProbeResult(
                run=RUN, round_id=rid, seed=s, version=0, worker_id=wids[j % workers], l_plus=1.0, l_minus=2.0
            )
            for s in seeds
        ]
        for j, (rid, seeds) in enumerate(_batches(rounds, batch))
    ]
    lat: list[float] = []
    lock = threading.Lock()

    def run(job: list[ProbeResult]) -> int:
        t0 = time.perf_counter()
        outs = intake.submit(job[0].worker_id, RUN, job)
        dt = (time.perf_counter() - t0) * 1e3
        with lock:
            lat.extend([dt] * len(job))
        return outs.count("accepted")

    load = os.getloadavg()[0]
    r0, c0, t0 = _redis_cpu(settings.redis_url), time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        accepted = sum(pool.map(run, jobs))
    seconds = time.perf_counter() - t0
    cpu = (time.process_time() - c0, 0.0, _redis_cpu(settings.redis_url) - r0)
    res = _finish(settings, "store", workers, batch, n_results, accepted, seconds, lat, cpu)
    res.load_avg_1m = round(load, 2)
    return res


def _wait_ready(url: str, proc: subprocess.Popen, coordinators: int, metrics_dir: Path) -> None:
    """Wait for /readyz and, with several coordinator processes, for each to have built its app (its
    metric files appear in `metrics_dir`) and a moment more for its start-up to finish."""
    deadline = time.monotonic() + 60
    while True:
        try:
            ready = httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            ready = False
        pids = {f.stem.rsplit("_", 1)[-1] for f in metrics_dir.glob("*.db")}
        if ready and (coordinators == 1 or len(pids) >= coordinators):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the coordinator process did not become ready")
        time.sleep(0.1)
    if coordinators > 1:
        time.sleep(1.0)  # app built -> lifespan (Redis pool opened) -> accepting: well under a second


def bench_http(
    settings: CoordinatorSettings,
    workers: int,
    n_results: int,
    batch: int,
    rate: float = 0.0,
    coordinators: int = 1,
) -> IntakeBenchResult:
    """Coordinator in a uvicorn subprocess (`coordinators` worker processes); `workers` asyncio simulated
    workers in this process."""
    from api.server import free_port, settings_env

    port = free_port()
    metrics_dir = settings.blob_dir / "prometheus"
    metrics_dir.mkdir()
    env = settings_env(settings)
    if coordinators > 1:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    else:
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd + ["--workers", str(coordinators)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, coordinators, metrics_dir)
        rounds = _setup_rounds(Store(settings), n_results)
        enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
        tokens = []
        for i in range(workers):
            reg = httpx.post(url + "/v1/workers", json={"name": f"sim{i}"}, headers=enroll, timeout=30).json()
            tokens.append((reg["worker_id"], reg["worker_token"]))
        load = os.getloadavg()[0]
        jobs = _batches(rounds, batch)
        # The load generator's own heap (jobs, imports) is static during the run: out of the collector's
        # way, a full collection cannot pause the simulated workers and inflate the measured latencies.
        gc.collect()
        gc.freeze()
        r0, s0, c0 = _redis_cpu(settings.redis_url), _tree_cpu(proc.pid), time.process_time()
        try:
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                accepted, seconds, lat = runner.run(post_results(url, RUN, tokens, jobs, rate))
        finally:
            gc.unfreeze()
        cpu = (_tree_cpu(proc.pid) - s0, time.process_time() - c0, _redis_cpu(settings.redis_url) - r0)
        res = _finish(settings, "http", workers, batch, n_results, accepted, seconds, lat, cpu)
        res.load_avg_1m, res.rate, res.coordinators = round(load, 2), rate, coordinators
        return res
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_intake_bench(
    mode: str,
    workers: int,
    n_results: int,
    batch: int,
    redis_url: str,
    rate: float = 0.0,
    key_prefix: str | None = None,
    coordinators: int = 1,
) -> IntakeBenchResult:
    """Run one bench on fresh keys (`key_prefix`, random by default; deleted afterwards).

    Raises ValueError on bad sizes.

    `rate` (results/s, http mode only): offered load of an open-loop run; 0 = closed loop, as fast as
    the coordinator answers. `coordinators` (http mode only): coordinator processes
    (`sparecycles coordinator --workers`).
    """
    if workers < 1 or n_results < 1 or not 1 <= batch <= 1024 or not 1 <= coordinators <= 64:
        raise ValueError("workers and results must be >= 1, batch in [1, 1024], coordinators in [1, 64]")
    prefix = key_prefix or "bench" + secrets.token_hex(4)
    with tempfile.TemporaryDirectory() as tmp:
        settings = generate_dev_settings(
            redis_url=redis_url, key_prefix=prefix, queue_prefix=f"{prefix}.probe", blob_dir=Path(tmp)
        )
        try:
            if mode == "http":
                return bench_http(settings, workers, n_results, batch, rate, coordinators)
            return bench_store(settings, workers, n_results, batch)
        finally:
            _cleanup(settings)


def result_dict(res: IntakeBenchResult) -> dict:
    """JSON-ready dict of a result, with the machine's CPU count."""
    return {**asdict(res), "cpus": os.cpu_count()}
