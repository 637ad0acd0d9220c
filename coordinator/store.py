"""Redis-backed coordinator state, split by concern into mixins composed here:

| module | concern |
|---|---|
| `coordinator.keys` | key layout (`Keys`), Redis client options |
| `coordinator.registry` | workers: registration, hashed tokens, leases, states |
| `coordinator.runs` | runs, snapshot versions, seed ledger |
| `coordinator.rounds` | probe rounds: open, progress, close; spot-check selection |
| `coordinator.dispatch` | probe tasks: building, publishing on Celery, queue depths |
| `coordinator.blobs` | content-addressed shard store on disk (`BlobStore`, held as `blobs`) |

Intake (results, spot checks) lives in `coordinator.intake`. Errors are the `CoordinatorError` family
(coordinator.errors); the API maps them to HTTP statuses. Worker tokens are stored only as sha256 digests.
"""

from __future__ import annotations

import redis
from celery import Celery

from coordinator.blobs import BlobStore
from coordinator.celery_app import make_celery
from coordinator.dispatch import Dispatch
from coordinator.keys import Keys, redis_client_kwargs, results_stream_key
from coordinator.registry import WorkerRegistry
from coordinator.rounds import RoundStore, spot_check_selected
from coordinator.runs import RunStore
from coordinator.settings import CoordinatorSettings

__all__ = ["Store", "redis_client_kwargs", "results_stream_key", "spot_check_selected"]


class Store(Keys, WorkerRegistry, RunStore, RoundStore, Dispatch):
    """Coordinator state on Redis. `settings.redis_url` holds state; the broker may be another URL."""

    def __init__(self, settings: CoordinatorSettings, celery_app: Celery | None = None) -> None:
        Keys.__init__(self, settings.key_prefix, settings.queue_prefix)
        self.settings = settings
        self.r = redis.Redis.from_url(
            settings.redis_url, decode_responses=True, health_check_interval=30, **redis_client_kwargs()
        )
        self.blobs = BlobStore(settings.blob_dir, settings.max_blob_bytes)
        self.celery = celery_app or make_celery(
            settings.worker_broker_url, visibility_timeout_s=settings.visibility_timeout_s
        )

    def ping(self) -> bool:
        """True if Redis answers."""
        return bool(self.r.ping())
