"""Helpers of the coordinator/API tests (conftest.py's `env` and `redis_url` wrap them): real Redis (DB 11, a unique key prefix per test), a real
uvicorn server in a thread, and helpers that play the trainer and the workers over HTTP."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from api.app import create_app
from api.server import ServerThread
from coordinator.settings import CoordinatorSettings, generate_dev_settings

REDIS_URL = "redis://127.0.0.1:6379/11"


def make_settings(tmp_path: Path, **overrides) -> CoordinatorSettings:
    """Dev settings isolated by a random key/queue prefix and a private blob directory."""
    prefix = "t" + secrets.token_hex(5)
    values = {
        "redis_url": REDIS_URL,
        "key_prefix": prefix,
        "queue_prefix": f"{prefix}.probe",
        "blob_dir": tmp_path / "blobs",
        "lease_seconds": 30.0,
        "heartbeat_interval_s": 1.0,
        "reaper_interval_s": 0.05,
    }
    values.update(overrides)
    return generate_dev_settings(**values)


def cleanup(settings: CoordinatorSettings) -> None:
    """Delete every Redis key of this test (state, Celery queues and kombu bindings)."""
    r = redis.Redis.from_url(settings.redis_url)
    for pattern in (f"{settings.key_prefix}*", f"_kombu.binding*.{settings.queue_prefix}*"):
        keys = list(r.scan_iter(pattern, count=1000))
        if keys:
            r.delete(*keys)


@dataclass
class Env:
    """A running coordinator: settings, base URL, an admin client and the raw Redis client."""

    settings: CoordinatorSettings
    url: str
    admin: httpx.Client
    r: redis.Redis

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def enroll(self, name: str) -> tuple[dict, httpx.Client]:
        """Register a worker; return (registration reply, client with its token)."""
        with self.client(self.settings.enrollment_token.get_secret_value()) as c:
            resp = c.post("/v1/workers", json={"name": name, "device": "cpu", "host": "test"})
        assert resp.status_code == 201, resp.text
        reg = resp.json()
        return reg, self.client(reg["worker_token"])

    def upload(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        resp = self.admin.put(f"/v1/blobs/{sha}", content=data)
        assert resp.status_code == 201, resp.text
        return sha

    def create_run(self, run: str, **spec) -> dict:
        body = {"run": run, "model_class": "GPT2LMHeadModel", **spec}
        resp = self.admin.post("/v1/runs", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def publish_version(self, run: str, version: int, payload: bytes) -> dict:
        sha = self.upload(payload)
        manifest = {
            "run": run,
            "version": version,
            "parent": None if version == 0 else version - 1,
            "shards": [{"name": "model-00001.safetensors", "sha256": sha, "bytes": len(payload)}],
            "param_order_hash": "0" * 64,
            "dtype": "float32",
            "model_class": "GPT2LMHeadModel",
        }
        resp = self.admin.post(f"/v1/runs/{run}/versions", json=manifest)
        assert resp.status_code == 201, resp.text
        return manifest

    def queue_messages(self, run: str) -> list[dict]:
        """Decode kombu's Redis messages on the run's queue: [{task, kwargs}] (oldest first)."""
        out = []
        for raw in reversed(self.r.lrange(f"{self.settings.queue_prefix}.{run}", 0, -1)):
            msg = json.loads(raw)
            assert msg["content-type"] == "application/json"
            args, kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
            out.append({"task": msg["headers"]["task"], "args": args, "kwargs": kwargs})
        return out


def running_env(tmp_path: Path, **overrides) -> Iterator[Env]:
    """Generator for a pytest fixture: start a real uvicorn server, yield an Env, clean up."""
    settings = make_settings(tmp_path, **overrides)
    app = create_app(settings)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        with ServerThread(app) as srv:
            admin = httpx.Client(
                base_url=srv.url,
                headers={"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"},
                timeout=30,
            )
            with admin:
                yield Env(settings, srv.url, admin, r)
    finally:
        cleanup(settings)


def round_body(run: str, rid: str, batch: str, seeds: list[int], *, want_clean: bool = False, **kw) -> dict:
    """A probe round as JSON (version 0, eps 1e-3, rademacher unless `kw` says otherwise)."""
    body = {"run": run, "round_id": rid, "version": 0, "batch_sha256": batch, "eps": 1e-3,
            "distribution": "rademacher", "seeds": seeds, "want_clean": want_clean}
    return {**body, **kw}


def open_spot_round(env: Env, run: str, rid: str, seeds: list[int]) -> dict:
    """Create `run` with every seed spot-checked (one seed per task, rtol 1e-6, atol 0), publish its version 0 and
    open round `rid` over `seeds`; returns the coordinator's reply to the round (asserts it was created)."""
    env.create_run(run, spot_check_fraction=1.0, spot_rtol=1e-6, spot_atol=0.0, seeds_per_task=1)
    env.publish_version(run, 0, b"w")
    reply = env.admin.post(f"/v1/runs/{run}/rounds", json=round_body(run, rid, env.upload(b"b"), seeds))
    assert reply.status_code == 201, reply.text
    return reply.json()


def result(run: str, rid: str, seed: int, wid: str, lp: float = 1.0, lm: float = 2.0, **kw) -> dict:
    """A probe result as JSON."""
    return {
        "run": run,
        "round_id": rid,
        "seed": seed,
        "version": kw.pop("version", 0),
        "worker_id": wid,
        "l_plus": lp,
        "l_minus": lm,
        **kw,
    }
