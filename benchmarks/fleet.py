"""`sparecycles bench fleet`: probe throughput of 1..N real CPU worker processes, and publish -> ready latency.

Everything is real: a coordinator process (uvicorn) on Redis, `python -m probe_worker.cli` worker
processes (Celery, solo pool), the trainer side through CoordinatorBackend. Throughput is seeds per
second over a timed round (each seed is two forward passes) after a warm-up round; publish -> ready is
the wall time from `CoordinatorBackend.publish` starting until every worker's heartbeat reports the
version loaded (workers prefetch new versions of the runs they serve; here they heartbeat every 0.1 s and look
for new versions every 0.2 s). With the trainer on a GPU, benchmarks.fleet_gpu adds background publishes, the
training loop's cost per published version and the worker's losses against in-process evaluation.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis
import torch

from benchmarks.fleet_gpu import compare_losses, publish_ready, trainer_cost
from benchmarks.options import FleetBenchOptions
from probe_worker.engine import die_with_parent
from trainer.batch_losses import loss_for_kind
from trainer.models import build_model
from trainer.zo.probes import RoundSpec
from wire import batch as batch_wire
from wire.messages import RunSpec
from wire.round_messages import EvalSpec, ProbeRound, WeightTerm

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FleetBenchResult:
    """Figures of one bench run. Rates are per second of wall time; latencies in seconds."""

    preset: str
    seeds: int
    seeds_per_task: int
    batch: tuple[int, int]
    threads_per_worker: int
    cpus: int
    probes_per_s: dict[int, float] = field(default_factory=dict)
    forward_passes_per_s: dict[int, float] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    kind: str = "seeded"  # the timed rounds' kind: seeded (probes, TF32) or eval (held-out batches, bf16 on CUDA)
    tokens_per_s: dict[int, float] = field(default_factory=dict)  # forward passes/s x batch rows x sequence length
    ready_preset: str = ""
    ready_bytes: int = 0
    publish_s: float = 0.0
    publish_to_ready_s: float = 0.0
    publish_timings: dict = field(default_factory=dict)  # the synchronous CPU publish's (CoordinatorBackend)
    blob_path: str = "shared"
    worker_devices: tuple[str, ...] = ("cpu",)
    trainer_device: str = "cpu"
    # with a trainer device (benchmarks.fleet_gpu): per version {call_s, uploaded_s, ready_s}, the training loop's
    # cost per version, the worker's losses against in-process evaluation; errors of phases that failed
    publish_ready_sync: list = field(default_factory=list)
    publish_ready_background: list = field(default_factory=list)
    trainer: dict = field(default_factory=dict)
    loss_compare: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)


class _Fleet:
    def __init__(self, redis_url: str, tmp: Path, threads: int, devices: tuple[str, ...] = ("cpu",),
                 blob_path: str = "shared", worker_args: tuple[str, ...] = ()) -> None:
        from api.server import free_port

        if blob_path not in ("shared", "http"):
            raise ValueError(f"blob_path must be 'shared' or 'http', got {blob_path!r}")
        # shared: trainer, coordinator and workers on one host use one blob directory (as `up` does); http: shards
        # travel over loopback HTTP, as to workers on other hosts
        self.blob_dir = tmp / "blobs" if blob_path == "shared" else None

        self.devices = devices or ("cpu",)
        self.worker_args = tuple(worker_args)
        self.prefix = "bench" + secrets.token_hex(4)
        self.redis_url, self.tmp, self.threads = redis_url, tmp, threads
        self.admin_token, self.enroll_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "SPARECYCLES_REDIS_URL": redis_url,
               "SPARECYCLES_KEY_PREFIX": self.prefix, "SPARECYCLES_QUEUE_PREFIX": f"{self.prefix}.probe",
               "SPARECYCLES_ADMIN_TOKEN": self.admin_token, "SPARECYCLES_ENROLLMENT_TOKEN": self.enroll_token,
               "SPARECYCLES_BLOB_DIR": str(tmp / "blobs"), "SPARECYCLES_VISIBILITY_TIMEOUT_S": "900"}
        code = ("import uvicorn; from api.app import create_app; from coordinator.settings import "
                "CoordinatorSettings; uvicorn.run(create_app(CoordinatorSettings()), host='127.0.0.1', "
                f"port={port}, log_level='warning')")
        log = open(tmp / "coordinator.log", "wb")  # noqa: SIM115 - the child owns it
        # A separate process, as in a deployment: the coordinator must not share this process's GIL.
        self.coord = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT)
        self.admin = httpx.Client(base_url=self.url, timeout=60,
                                  headers={"Authorization": f"Bearer {self.admin_token}"})
        self.procs: list[subprocess.Popen] = []
        self.started = 0
        self.wait(self._ready, "the coordinator")

    def _ready(self) -> bool:
        if self.coord.poll() is not None:
            tail = (self.tmp / "coordinator.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the coordinator exited; its log ends:\n{tail}")
        try:
            return self.admin.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def start_workers(self, n: int) -> list[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "SPARECYCLES_CACHE": str(self.tmp / "cache")}
        env.pop("SPARECYCLES_BLOB_DIR", None)
        if self.blob_dir is not None:
            env["SPARECYCLES_BLOB_DIR"] = str(self.blob_dir)
        names = [f"bench-{self.started + i}" for i in range(n)]
        self.started += n
        for i, name in enumerate(names):
            log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
            device = self.devices[i % len(self.devices)]  # round-robin over the listed devices
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "probe_worker.cli", "--coordinator", self.url, "--token",
                 self.enroll_token, "--name", name, "--threads", str(self.threads), "--device", device,
                 "--cache-dir", str(self.tmp / f"cache-{name}"), "--log-level", "WARNING",
                 "--prefetch-interval", "0.2", "--control-interval", "0.1", *self.worker_args], env=env, cwd=ROOT, stdout=log,
                # each a session of its own, as a service manager (and `up`) starts a worker: beside an engine it
                # lowers its autogroup and starts its freeze watcher only so (probe_worker.priority, .freeze); out of
                # the bench's session Ctrl-C no longer reaches it, so it gets SIGTERM when the bench ends, however
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent))
        self.wait(lambda: all(self.info(nm) and self.info(nm)["last_heartbeat"] > self.info(nm)["registered_at"]
                              for nm in names), "workers to start")
        return names

    def info(self, name: str) -> dict | None:
        found = [w for w in self.admin.get("/v1/workers").json() if w["name"] == name]
        return found[-1] if found else None

    def wait(self, cond, what: str, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            for p in self.procs:
                if p.poll() not in (None, 0, -signal.SIGTERM, 128 + signal.SIGTERM):  # a stop by SIGTERM exits 143
                    raise RuntimeError(f"a worker exited with {p.returncode}; logs in {self.tmp}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.tmp}")
            time.sleep(0.05)

    def stop_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []

    def backend(self, model, run: str, seeds_per_task: int, background: bool = False):
        from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress

        spec = RunSpec(run=run, model_class=type(model).__name__, spot_check_fraction=0.0,
                       seeds_per_task=seeds_per_task)
        return CoordinatorBackend.connect(model, spec, FleetAddress(self.url, self.admin_token, self.redis_url,
                                                                    self.prefix),
                                          BackendTuning(round_timeout_s=3600.0, history=0, background=background,
                                                        blob_dir=self.blob_dir))

    def close(self) -> None:
        self.stop_workers()
        self.coord.terminate()
        self.coord.wait(timeout=30)
        self.admin.close()
        r = redis.Redis.from_url(self.redis_url)
        for pattern in (f"{self.prefix}*", f"_kombu.binding*.{self.prefix}*"):
            keys = list(r.scan_iter(pattern, count=1000))
            if keys:
                r.delete(*keys)


def _batch(b: int, t: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run_fleet_bench(opts: FleetBenchOptions, devices: tuple[str, ...] = ("cpu",),
                    save: Callable[[FleetBenchResult], None] = lambda r: None) -> FleetBenchResult:
    """Measure probes/s for each worker count of opts.workers and publish -> ready latency of opts.ready_preset
    weights (benchmarks.options.FleetBenchOptions: every option of `bench fleet`).

    Worker i runs on devices[i % len(devices)] (e.g. ("cuda:1", "cuda:2"), fleet.devices.place_here of
    opts.device). With the publishing side on the CPU (opts.trainer_device "cpu") publish -> ready is one
    synchronous publish; on a GPU (benchmarks.fleet_gpu) it is two synchronous and two background publishes of a
    model on that device, plus the training loop's cost per published version over opts.interval steps at
    opts.train_batch. opts.compare_seeds > 0 compares the timed round's first seeds with in-process evaluation on the
    first worker's device. `save(result)` is called after each phase. opts.blob_path: "shared" (the trainer writes
    shards into the coordinator's blob directory and the workers read them there, as under `up`) or "http" (over
    loopback HTTP, as to other hosts). opts.kind: the timed rounds' kind, "seeded" (probe rounds: two forwards per
    seed) or "eval" (an eval round, one held-out batch of opts.batch rows per seed, one forward each: bf16 on a CUDA
    worker, trainer.zo.probes.forward_dtype). Raises RuntimeError if a worker dies or a phase exceeds its (generous)
    time limit.
    """
    batch, trainer_device, counts = opts.batch, opts.trainer_device, opts.workers
    res = FleetBenchResult(opts.preset, opts.seeds, opts.seeds_per_task, batch, opts.threads, os.cpu_count() or 1,
                           worker_devices=tuple(devices), trainer_device=trainer_device, blob_path=opts.blob_path,
                           kind=opts.kind, worker_args=opts.worker_args)
    keep = os.environ.get("SPARECYCLES_BENCH_KEEP") == "1"  # keep the coordinator's and workers' logs
    with (contextlib.nullcontext(tempfile.mkdtemp(prefix="sparecycles-bench-")) if keep
          else tempfile.TemporaryDirectory(prefix="sparecycles-bench-")) as tmp:
        fleet = _Fleet(opts.redis_url, Path(tmp), opts.threads, devices, opts.blob_path, opts.worker_args)
        try:
            model = build_model(opts.preset)
            xb = _batch(*batch, model.config.vocab_size, seed=0)
            for n in counts:
                names = fleet.start_workers(n)
                if opts.kind == "eval":
                    _eval_phase(fleet, names, res, model, opts.seeds, opts.seeds_per_task, save)
                    got = []
                else:
                    got = _throughput_phase(fleet, names, res, model, xb, opts.seeds, opts.seeds_per_task, save)
                if opts.compare_seeds and n == counts[0] and got:
                    _compare_phase(res, got, model, xb, devices[0], opts.compare_seeds, save)
                if n != counts[-1]:
                    fleet.stop_workers()
            ready = opts.ready_preset
            if ready and trainer_device != "cpu":
                _gpu_publish_phases(fleet, names, res, ready, build_model(ready, device=trainer_device),
                                    opts.seeds_per_task, opts.interval, opts.train_batch, save)
            elif ready:
                _cpu_publish_phase(fleet, names, res, ready, build_model(ready), opts.seeds_per_task)
        finally:
            fleet.close()
    return res


def _throughput_phase(fleet: _Fleet, names: list[str], res: FleetBenchResult, model, xb, seeds: int,
                      seeds_per_task: int, save: Callable[[FleetBenchResult], None]) -> list:
    """With the workers `names` consuming: publish version 0, wait for it on every worker, run a warm-up round,
    then time one round of `seeds` seeds (submit -> every result collected) into res.probes_per_s and
    res.forward_passes_per_s under the worker count; save. Returns the timed round's SeedResults. Raises
    RuntimeError when the round returns fewer seeds."""
    n = len(names)
    be = fleet.backend(model, f"fleet-{n}", seeds_per_task)
    be.publish(0)
    fleet.wait(lambda names=names: all(fleet.info(nm)["version"] == 0 for nm in names),
               "weights on every worker")
    warm = RoundSpec("warm", 0, xb, 1e-3, tuple(range(n * seeds_per_task * 2)), "rademacher")
    be.submit(warm)
    be.collect("warm")
    rnd = RoundSpec("timed", 0, xb, 1e-3, tuple(range(10_000, 10_000 + seeds)), "rademacher")
    t0 = time.perf_counter()
    be.submit(rnd)
    got = be.collect("timed").results
    dt = time.perf_counter() - t0
    if len(got) != seeds:
        raise RuntimeError(f"timed round returned {len(got)} of {seeds} seeds")
    res.probes_per_s[n] = seeds / dt
    res.forward_passes_per_s[n] = 2 * seeds / dt
    res.tokens_per_s[n] = 2 * seeds * xb[0].numel() / dt
    be.close()
    save(res)
    return got


def _eval_phase(fleet: _Fleet, names: list[str], res: FleetBenchResult, model, seeds: int, seeds_per_task: int,
                save: Callable[[FleetBenchResult], None]) -> None:
    """As `_throughput_phase` with eval rounds (fleet.evaluation's wire form): `seeds` held-out batches of res.batch
    (random tokens), one forward each; a warm-up round (compiles), then one timed round into res.forward_passes_per_s
    (= probes_per_s: results/s) and res.tokens_per_s; save. Raises RuntimeError when the round returns fewer."""
    import hashlib

    n = len(names)
    b, t = res.batch
    be = fleet.backend(model, f"fleet-eval-{n}", seeds_per_task)
    be.publish(0)
    fleet.wait(lambda names=names: all(fleet.info(nm)["version"] == 0 for nm in names), "weights on every worker")
    x, y = _batch(seeds * b, t, model.config.vocab_size, seed=3)
    blob = batch_wire.encode_batch((x, y), "lm")

    def wire(rid: str, count: int):
        return ProbeRound(schema_version=3, run=be.run, round_id=rid, version=0,
                          batch_sha256=hashlib.sha256(blob).hexdigest(), eps=1.0, distribution="rademacher",
                          seeds=list(range(count)), kind="eval",
                          eval=EvalSpec(split="bench", batch_size=b, weights=[WeightTerm(version=0, coeff=1.0)]))

    be.submit_wire(wire("warm", min(seeds, n * seeds_per_task * 2)), blob)
    be.collect("warm")
    t0 = time.perf_counter()
    be.submit_wire(wire("timed", seeds), blob)
    got = be.collect("timed").results
    dt = time.perf_counter() - t0
    if len(got) != seeds:
        raise RuntimeError(f"timed eval round returned {len(got)} of {seeds} batches")
    res.probes_per_s[n] = res.forward_passes_per_s[n] = seeds / dt
    res.tokens_per_s[n] = seeds * b * t / dt
    be.close()
    save(res)


def _compare_phase(res: FleetBenchResult, got: list, model, xb, device: str, compare_seeds: int,
                   save: Callable[[FleetBenchResult], None]) -> None:
    """The timed round's first `compare_seeds` results against in-process evaluation on `device`
    (benchmarks.fleet_gpu.compare_losses) into res.loss_compare; an error is kept in res.errors instead; save."""
    try:
        res.loss_compare = compare_losses(got, model, xb, loss_for_kind("lm"), 1e-3, "rademacher",
                                          device, compare_seeds)
    except Exception as exc:  # noqa: BLE001 - keep the other figures
        res.errors["loss_compare"] = repr(exc)[:2000]
    save(res)


def _cpu_publish_phase(fleet: _Fleet, names: list[str], res: FleetBenchResult, ready_preset: str, big,
                       seeds_per_task: int) -> None:
    """Publish -> ready from the CPU: one synchronous publish of `big` (the `ready_preset` model) as version 4242,
    timed until every worker in `names` reports it; into res.publish_s, publish_to_ready_s, publish_timings,
    ready_preset and ready_bytes."""
    be = fleet.backend(big, "ready", seeds_per_task)
    t0 = time.perf_counter()
    be.publish(4242)
    res.publish_s = time.perf_counter() - t0
    fleet.wait(lambda names=names: all(fleet.info(nm)["version"] == 4242 for nm in names),
               "ready on every worker")
    res.publish_to_ready_s = time.perf_counter() - t0
    res.publish_timings = be.publisher.publish_timings.get(4242, {})
    res.ready_preset = ready_preset
    res.ready_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    be.close()


def _gpu_publish_phases(fleet: _Fleet, names: list[str], res: FleetBenchResult, ready_preset: str, big,
                        seeds_per_task: int, interval: int, train_batch: tuple[int, int], save) -> None:
    """publish -> ready (synchronous, then background) and the training loop's cost of a model on a GPU."""
    torch.set_float32_matmul_precision("high")  # the trainer's precision on CUDA (trainer.train)
    res.ready_preset = ready_preset
    res.ready_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    for background, versions, key in ((False, [1, 2], "publish_ready_sync"), (True, [3, 4], "publish_ready_background")):
        try:
            be = fleet.backend(big, "ready-bg" if background else "ready", seeds_per_task, background=background)
            rows = publish_ready(fleet, names, be, big, versions)
            setattr(res, key, rows)
            if not background:
                res.publish_s, res.publish_to_ready_s = rows[-1]["call_s"], rows[-1]["ready_s"]
            else:
                xb = tuple(t.to(res.trainer_device) for t in _batch(*train_batch, big.config.vocab_size, seed=5))
                res.trainer = trainer_cost(be, big, xb, loss_for_kind("lm"), interval, repeats=2)
            be.close()
        except Exception as exc:  # noqa: BLE001 - keep the other figures
            res.errors[key] = repr(exc)[:2000]
        save(res)


def result_dict(res: FleetBenchResult) -> dict:
    """JSON-ready dict of a FleetBenchResult."""
    return asdict(res)
