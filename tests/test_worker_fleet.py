"""End-to-end fleet tests: real Redis (DB 12, unique key/queue prefix), a real coordinator process
(uvicorn in a subprocess), real probe-worker processes (`python -m probe_worker.cli`, Celery solo pool),
and the trainer side through `CoordinatorBackend`.

The tests share one coordinator and run in file order (equivalence, elastic, kill), because starting
worker processes dominates the cost on a 2-core machine.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from coordinator.messages import RunSpec
from fleet.backend import CoordinatorBackend
from kernels import ProbeEvaluator
from trainer.models.gpt2 import init_gpt2_weights_
from trainer.train import lm_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import RoundSpec

REDIS_URL = "redis://127.0.0.1:6379/12"
ROOT = Path(__file__).resolve().parents[1]
VISIBILITY_S = 5
START_TIMEOUT_S = 60.0


def loss_fn(model, batch):
    """The loss the fleet's workers use: mean token cross-entropy of (x, y)."""
    return lm_loss(model, batch[0], batch[1])


def tiny_model(n_embd: int = 32, n_layer: int = 2, seed: int = 0) -> GPT2LMHeadModel:
    """A small GPT-2 (vocab 128, no dropout) with deterministic GPT-2 init from `seed`."""
    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        model = GPT2LMHeadModel(cfg)
    init_gpt2_weights_(model, seed)
    return model.eval()


def make_batch(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (b, t) over vocab 128, y = x shifted by one, from an explicit generator."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (b, t + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """A coordinator subprocess plus helpers to start worker subprocesses and talk to both."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.prefix = "tw" + secrets.token_hex(4)
        self.admin_token, self.enroll_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.env = {
            **os.environ, "PYTHONPATH": str(ROOT), "SPARECYCLES_REDIS_URL": REDIS_URL,
            "SPARECYCLES_KEY_PREFIX": self.prefix, "SPARECYCLES_QUEUE_PREFIX": f"{self.prefix}.probe",
            "SPARECYCLES_ADMIN_TOKEN": self.admin_token, "SPARECYCLES_ENROLLMENT_TOKEN": self.enroll_token,
            "SPARECYCLES_BLOB_DIR": str(tmp / "blobs"), "SPARECYCLES_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S),
            "SPARECYCLES_LEASE_SECONDS": "4", "SPARECYCLES_HEARTBEAT_INTERVAL_S": "0.5",
            "SPARECYCLES_REAPER_INTERVAL_S": "0.2", "SPARECYCLES_CACHE": str(tmp / "cache"),
        }
        self.logs = []
        self.start_coordinator()
        self.admin = httpx.Client(base_url=self.url, timeout=30,
                                  headers={"Authorization": f"Bearer {self.admin_token}"})
        self.r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        self.workers: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, int] = {}
        self.wait(lambda: self._ready(), "coordinator /readyz")

    def start_coordinator(self) -> None:
        """Start the coordinator process on this fleet's port (its state lives in Redis and the blob dir)."""
        port = self.url.rsplit(":", 1)[1]
        code = ("import uvicorn; from api.app import create_app; from coordinator.settings import "
                "CoordinatorSettings; uvicorn.run(create_app(CoordinatorSettings()), host='127.0.0.1', "
                f"port={port}, log_level='warning')")
        self.logs.append(open(self.tmp / "coordinator.log", "ab"))  # noqa: SIM115 - closed in close()
        self.coord = subprocess.Popen([sys.executable, "-c", code], env=self.env, cwd=ROOT,
                                      stdout=self.logs[-1], stderr=subprocess.STDOUT)

    def _ready(self) -> bool:
        try:
            return self.admin.get("/readyz").status_code == 200
        except httpx.TransportError:
            assert self.coord.poll() is None, (self.tmp / "coordinator.log").read_text()
            return False

    @staticmethod
    def wait(cond, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll `cond` every 50 ms until true; fail the test after `timeout_s` (a liveness bound only)."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}")
            time.sleep(0.05)

    def start_worker(self, name: str) -> subprocess.Popen:
        """Start `python -m probe_worker.cli` for `name` with its own cache folder."""
        self.metrics_ports[name] = _free_port()
        cmd = [sys.executable, "-m", "probe_worker.cli", "--coordinator", self.url, "--token", self.enroll_token,
               "--name", name, "--cache-dir", str(self.tmp / f"cache-{name}"), "--control-interval", "0.25",
               "--soft-shutdown", "5", "--threads", "1", "--loglevel", "INFO",
               "--metrics-port", str(self.metrics_ports[name])]
        self.logs.append(open(self.tmp / f"{name}.log", "wb"))  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=self.logs[-1], stderr=subprocess.STDOUT)
        self.workers[name] = proc
        return proc

    def worker_info(self, name: str) -> dict | None:
        """The newest registration named `name` (GET /v1/workers), or None."""
        found = [w for w in self.admin.get("/v1/workers").json() if w["name"] == name]
        return max(found, key=lambda w: w["registered_at"]) if found else None

    def wait_consuming(self, name: str) -> str:
        """Wait until worker `name` heartbeats after registering (its Celery consumer is up); return its id."""
        def ready() -> bool:
            assert self.workers[name].poll() is None, (self.tmp / f"{name}.log").read_text()[-3000:]
            info = self.worker_info(name)
            return info is not None and info["last_heartbeat"] > info["registered_at"] + 0.2
        self.wait(ready, f"worker {name}")
        time.sleep(0.5)  # the first queue reconcile follows the first heartbeat
        return self.worker_info(name)["worker_id"]

    def metric(self, name: str, metric: str) -> float:
        """Value of an unlabelled metric scraped from worker `name`'s /metrics endpoint."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
        raise AssertionError(f"{metric} not exported by worker {name}")

    def backend(self, model, run: str, **spec) -> CoordinatorBackend:
        """A CoordinatorBackend on a fresh run `run` (no spot checks unless given)."""
        spec = {"spot_check_fraction": 0.0, "seeds_per_task": 2, **spec}
        return CoordinatorBackend(
            model, coordinator_url=self.url, admin_token=self.admin_token, redis_url=REDIS_URL,
            run=RunSpec(run=run, model_class=type(model).__name__, **spec), key_prefix=self.prefix,
            round_timeout_s=120.0,
        )

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.coord.terminate()
        self.coord.wait(timeout=15)
        self.admin.close()
        for f in self.logs:
            f.close()
        for pattern in (f"{self.prefix}*", f"_kombu.binding*.{self.prefix}*"):
            keys = list(self.r.scan_iter(pattern, count=1000))
            if keys:
                self.r.delete(*keys)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    f.start_worker("a")
    f.start_worker("b")
    try:
        yield f
    finally:
        f.close()


def _by_seed(results):
    out = {}
    for r in results:
        assert r.seed not in out, f"seed {r.seed} delivered twice"
        out[r.seed] = r
    return out


def test_fleet_equals_in_process(fleet):
    """A round through coordinator + 2 worker processes returns bit-identical L+, L-, L0 to the in-process
    backend and to the kernels' ProbeEvaluator, for both distributions and two versions."""
    model = tiny_model()
    be = fleet.backend(model, "equiv")
    ids = {fleet.wait_consuming("a"), fleet.wait_consuming("b")}
    ref = InProcessBackend(model, loss_fn)
    batch = make_batch(4, 16, seed=1)
    for version, dist in ((0, "gauss8"), (1, "rademacher")):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # a real new version: every weight changed
        be.publish(version)
        ref.publish(version)
        seeds = tuple(range(1000 + 10 * version, 1008 + 10 * version))
        rnd = RoundSpec(f"eq-{version}", version, batch, eps=1e-2, seeds=seeds, dist=dist, want_clean=True)
        be.submit(rnd)
        fleet_res = _by_seed(be.collect(rnd.round_id).results)
        ref.submit(rnd)
        ref_res = _by_seed(ref.collect(rnd.round_id).results)
        assert set(fleet_res) == set(seeds)
        ev = ProbeEvaluator(model, loss_fn)
        for s in seeds:
            f, r = fleet_res[s], ref_res[s]
            assert (f.l_plus, f.l_minus, f.l0, f.version) == (r.l_plus, r.l_minus, r.l0, version)
            assert f.l_plus == ev.loss(batch, s, 1e-2, dist) and f.l_minus == ev.loss(batch, s, -1e-2, dist)
            assert f.l_plus != f.l_minus  # the perturbation really moved the loss
            assert f.worker in ids
        ev.close()
    assert be.collect().results == []  # nothing delivered twice
    be.close()


def test_elastic_drain_and_join(fleet):
    """A worker drained over REST evaluates nothing and loses nothing; a worker started mid-run receives
    tasks; SIGUSR1 drains locally and SIGUSR2 resumes."""
    model = tiny_model()
    be = fleet.backend(model, "elastic")
    id_a, id_b = fleet.wait_consuming("a"), fleet.wait_consuming("b")
    be.publish(0)
    batch = make_batch(4, 16, seed=2)
    assert fleet.admin.post(f"/v1/workers/{id_a}/drain").json()["state"] == "draining"
    fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_draining") == 1.0, "worker a draining")
    done_a = fleet.metric("a", "sparecycles_worker_probes_evaluated_total")
    fleet.start_worker("c")
    id_c = fleet.wait_consuming("c")
    seeds = tuple(range(2000, 2024))
    be.submit(RoundSpec("el-0", 0, batch, eps=1e-2, seeds=seeds, dist="gauss8"))
    res = _by_seed(be.collect("el-0").results)
    assert set(res) == set(seeds)
    workers = {r.worker for r in res.values()}
    assert id_a not in workers and id_c in workers and workers <= {id_b, id_c}
    assert fleet.metric("a", "sparecycles_worker_probes_evaluated_total") == done_a

    # Resume a over REST, then drain b and c locally with SIGUSR1: only a may evaluate the next round.
    assert fleet.admin.post(f"/v1/workers/{id_a}/resume").json()["state"] == "active"
    fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_draining") == 0.0, "worker a resumed")
    for name in ("b", "c"):
        fleet.workers[name].send_signal(signal.SIGUSR1)
    for name in ("b", "c"):
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 1.0, f"worker {name} drained")
    seeds = tuple(range(2100, 2108))
    be.submit(RoundSpec("el-1", 0, batch, eps=1e-2, seeds=seeds, dist="rademacher"))
    res = _by_seed(be.collect("el-1").results)
    assert set(res) == set(seeds) and {r.worker for r in res.values()} == {id_a}
    for name in ("b", "c"):
        fleet.workers[name].send_signal(signal.SIGUSR2)
    for name in ("b", "c"):
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 0.0, f"worker {name} resumed")
    be.close()


def test_lying_worker_is_quarantined_and_never_used(fleet):
    """With every seed spot-checked, a worker that posts wrong losses first is outvoted by two honest
    worker processes, quarantined, and the trainer receives only the honest (in-process) values."""
    model = tiny_model(seed=4)
    be = fleet.backend(model, "trust", spot_check_fraction=1.0, seeds_per_task=1)
    ids = {name: fleet.wait_consuming(name) for name in ("a", "b", "c")}
    be.publish(0)
    batch = make_batch(4, 16, seed=4)
    for wid in ids.values():  # hold the honest fleet back so the liar's values are the first replica
        fleet.admin.post(f"/v1/workers/{wid}/drain")
    for name in ids:
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 1.0, f"{name} draining")
    seeds = (4000, 4001, 4002)
    rnd = RoundSpec("t-0", 0, batch, eps=1e-2, seeds=seeds, dist="gauss8")
    be.submit(rnd)
    enroll = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.enroll_token}"})
    reg = enroll.post("/v1/workers", json={"name": "liar"}).json()
    liar = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {reg['worker_token']}"})
    lies = [{"run": "trust", "round_id": "t-0", "seed": s, "version": 0, "worker_id": reg["worker_id"],
             "replica": 0, "l_plus": 1.0, "l_minus": 2.0} for s in seeds]
    assert liar.post("/v1/runs/trust/results", json={"results": lies}).json()["outcomes"] == ["held"] * 3
    for wid in ids.values():
        fleet.admin.post(f"/v1/workers/{wid}/resume")
    res = _by_seed(be.collect("t-0").results)
    ref = InProcessBackend(model, loss_fn)
    ref.submit(rnd)
    truth = _by_seed(ref.collect("t-0").results)
    assert set(res) == set(seeds)
    for s in seeds:
        assert (res[s].l_plus, res[s].l_minus) == (truth[s].l_plus, truth[s].l_minus)
        assert res[s].worker in set(ids.values())
    assert fleet.admin.get(f"/v1/workers/{reg['worker_id']}").json()["state"] == "quarantined"
    assert liar.post("/v1/runs/trust/results", json={"results": lies[:1]}).json()["outcomes"] == ["quarantined"]
    enroll.close()
    liar.close()
    be.close()


def test_sigkill_mid_round_loses_nothing(fleet):
    """SIGKILL a worker while it evaluates a task: its task is redelivered after the visibility timeout and
    every seed reaches the trainer exactly once (one accepted stream event per seed)."""
    model = tiny_model(n_embd=64, n_layer=4, seed=3)
    be = fleet.backend(model, "kill")
    for name in ("a", "b", "c"):
        fleet.wait_consuming(name)
    be.publish(0)
    batch = make_batch(8, 48, seed=3)
    seeds = tuple(range(3000, 3024))
    be.submit(RoundSpec("k-0", 0, batch, eps=1e-2, seeds=seeds, dist="gauss8", want_clean=True))
    log_b = fleet.tmp / "b.log"
    fleet.wait(lambda: log_b.read_text().count("round k-0 seeds") >= 1, "worker b to finish a task")
    fleet.wait(lambda: log_b.read_text().rsplit("round k-0 seeds", 1)[1].count("] received") >= 1,
               "worker b to start its next task")
    fleet.workers["b"].send_signal(signal.SIGKILL)
    fleet.workers["b"].wait(timeout=10)
    tail = log_b.read_text().rsplit("] received", 1)[1]
    assert "succeeded" not in tail  # b died inside a task, before acknowledging it
    res = _by_seed(be.collect("k-0").results)
    assert set(res) == set(seeds)
    l0s = {r.l0 for r in res.values()}
    assert len(l0s) == 1  # every worker computed the same clean loss
    stream = fleet.r.xrange(f"{fleet.prefix}:{{kill}}:results")
    accepted = [e for _, e in stream if '"accepted"' in e["e"]]
    assert len(accepted) == len(seeds)
    be.close()


def test_coordinator_restart_mid_round_loses_and_doubles_nothing(fleet):
    """SIGKILL the coordinator while workers evaluate a round and start a new one on the same port: the
    workers retry/requeue, the round completes, one accepted stream event per seed, values unchanged."""
    model = tiny_model(seed=7)
    be = fleet.backend(model, "restart")
    for name in ("a", "c"):
        fleet.wait_consuming(name)
    be.publish(0)
    batch = make_batch(4, 32, seed=7)
    seeds = tuple(range(5000, 5040))
    rnd = RoundSpec("rs-0", 0, batch, eps=1e-2, seeds=seeds, dist="rademacher", want_clean=True)
    be.submit(rnd)
    stream_key = f"{fleet.prefix}:{{restart}}:results"
    fleet.wait(lambda: fleet.r.xlen(stream_key) >= 2, "first results")
    fleet.coord.send_signal(signal.SIGKILL)
    fleet.coord.wait(timeout=10)
    assert fleet.r.xlen(stream_key) < len(seeds)  # the round really was cut mid-way
    fleet.start_coordinator()
    fleet.wait(fleet._ready, "restarted coordinator")
    res = _by_seed(be.collect("rs-0").results)
    assert set(res) == set(seeds)
    ref = InProcessBackend(model, loss_fn)
    ref.submit(rnd)
    for r in ref.collect("rs-0").results:
        assert (res[r.seed].l_plus, res[r.seed].l_minus, res[r.seed].l0) == (r.l_plus, r.l_minus, r.l0)
    accepted = [e for _, e in fleet.r.xrange(stream_key) if '"accepted"' in e["e"]]
    assert len(accepted) == len(seeds)
    be.close()
