"""The weight-cache tests' coordinator: a real FastAPI server in a thread on real Redis (DB 12), a trainer-side
CoordinatorBackend and registered workers; shared by test_worker_cache, test_shared_blobs and test_long_poll."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import redis
import torch
from transformers import GPT2LMHeadModel

from api.app import create_app
from api.server import ServerThread
from coordinator.client import CoordinatorClient
from coordinator.settings import generate_dev_settings
from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from support.models import tiny_gpt2
from wire.messages import RunSpec, WorkerRegistration

REDIS_URL = "redis://127.0.0.1:6379/12"


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    return tiny_gpt2(vocab_size=96, n_positions=32, seed=seed)


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class Env:
    """Coordinator in a thread + helpers; `backend(run)` is the trainer, `worker()` a registered worker."""

    def __init__(self, tmp_path) -> None:
        self.prefix = "tc" + secrets.token_hex(4)
        self.settings = generate_dev_settings(
            redis_url=REDIS_URL, key_prefix=self.prefix, queue_prefix=f"{self.prefix}.probe",
            blob_dir=tmp_path / "blobs", reaper_interval_s=0.5,
        )
        self.server = ServerThread(create_app(self.settings)).start()
        self.tmp = tmp_path

    def backend(self, model, run: str, **spec) -> CoordinatorBackend:
        return CoordinatorBackend.connect(
            model, RunSpec(run=run, model_class=type(model).__name__, spot_check_fraction=0.0, **spec),
            FleetAddress(self.server.url, self.settings.admin_token.get_secret_value(), REDIS_URL, self.prefix),
            BackendTuning(round_timeout_s=30.0, shard_bytes=4096),
        )

    def worker(self, name: str) -> tuple[CoordinatorClient, str]:
        client = CoordinatorClient(self.server.url, timeout_s=10, attempts=2)
        reg = client.register(WorkerRegistration(name=name), self.settings.enrollment_token.get_secret_value())
        return client, reg.worker_id

    def close(self) -> None:
        self.server.stop()
        r = redis.Redis.from_url(REDIS_URL)
        for pattern in (f"{self.prefix}*", f"_kombu.binding*.{self.prefix}*"):
            keys = list(r.scan_iter(pattern, count=1000))
            if keys:
                r.delete(*keys)


def worker_env(tmp_path) -> Iterator[Env]:
    """An Env for one test (the body of each module's `env` fixture); its keys are deleted afterwards."""
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.close()


def params_of(model) -> list[tuple[str, torch.Tensor]]:
    """(name, detached clone) of every parameter, in named_parameters() order."""
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


