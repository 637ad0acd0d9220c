"""A real fleet for end-to-end tests: real Redis (DB 12, a unique key/queue prefix per fleet), a coordinator
process (uvicorn in a subprocess) and probe-worker processes (`python -m probe_worker.cli`, Celery solo pool),
with the trainer side through `CoordinatorBackend`. conftest.py's `fleet` fixture starts one with two workers."""

from __future__ import annotations

import contextlib
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

from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from probe_worker.engine import die_with_parent
from support.paths import ROOT
from wire.messages import RunSpec

REDIS_URL = "redis://127.0.0.1:6379/12"
VISIBILITY_S = 5
START_TIMEOUT_S = 180.0  # a liveness bound only: a worker process starts in ~10 s, far slower on a loaded 2-core CI


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

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        """Start `python -m probe_worker.cli` for `name` with its own cache folder (`extra`: more CLI options)."""
        self.metrics_ports[name] = _free_port()
        cmd = [sys.executable, "-m", "probe_worker.cli", "--coordinator", self.url, "--token", self.enroll_token,
               "--name", name, "--cache-dir", str(self.tmp / f"cache-{name}"), "--control-interval", "0.25",
               "--soft-shutdown", "5", "--threads", "1", "--log-level", "INFO",
               "--metrics-port", str(self.metrics_ports[name]), *extra]
        self.logs.append(open(self.tmp / f"{name}.log", "wb"))  # noqa: SIM115 - closed in close()
        # a worker beside an engine starts as a session of its own, as `up` and a service manager start it: only so
        # does it lower its autogroup and start its freeze watcher (probe_worker.priority, .freeze); it gets SIGTERM
        # if this process dies (out of pytest's session, Ctrl-C no longer reaches it)
        own = {"start_new_session": True, "preexec_fn": die_with_parent} if "--serving-metrics" in extra else {}
        proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=self.logs[-1], stderr=subprocess.STDOUT, **own)
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
        return CoordinatorBackend.connect(
            model, RunSpec(run=run, model_class=type(model).__name__, **spec),
            FleetAddress(self.url, self.admin_token, REDIS_URL, self.prefix), BackendTuning(round_timeout_s=120.0),
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



class AclFleet(Fleet):
    """A Fleet whose coordinator uses the store at `redis_url` (a private `support.valkey.Valkey`, whose restart a
    test controls) with per-worker broker users (SPARECYCLES_BROKER_ACL=1)."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.redis_url = redis_url
        super().__init__(tmp)

    def start_coordinator(self) -> None:
        self.env.update(SPARECYCLES_REDIS_URL=self.redis_url, SPARECYCLES_BROKER_ACL="1")
        super().start_coordinator()


@contextlib.contextmanager
def one_worker(tmp: Path):
    """A Fleet in `tmp` with one consuming worker "a"; yields (fleet, fleet.attach.FleetSettings a trainer attaches
    with) and closes the fleet afterwards."""
    from fleet.attach import FleetSettings

    procs = Fleet(tmp)
    try:
        procs.start_worker("a")
        procs.wait_consuming("a")
        yield procs, FleetSettings(admin_token=procs.admin_token, redis_url=REDIS_URL, key_prefix=procs.prefix)
    finally:
        procs.close()
