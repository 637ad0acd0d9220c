"""Redis-backed coordinator state: `Store` composes one part per concern, each built with what it uses.

| part | module | concern | built with |
|---|---|---|---|
| `keys` | `coordinator.keys` | key layout (`Keys`), Redis client options | prefixes |
| `blobs` | `coordinator.blobs` | content-addressed shard store on disk (`BlobStore`) | directory, size cap |
| `runs` | `coordinator.runs` | runs, snapshot versions, seed ledger, the runs' queues | r, keys, blobs |
| `dispatch` | `coordinator.dispatch` | probe tasks: building, publishing on Celery, queue depths | r, keys, runs, celery, broker URL |
| `rounds` | `coordinator.rounds` | probe rounds: open, progress, close; spot-check selection | r, keys, runs, dispatch, blobs |
| `teachers` | `coordinator.teachers` | teacher runs (their queues) and their teachers' blob manifests | r, keys, blobs |
| `workers` | `coordinator.registry` | workers: registration, hashed tokens, leases, states, broker users | r, keys, settings, runs, teachers |
| `shares` | `coordinator.shares` | runs' shares and worker-seconds; the run each heartbeat tells a worker to consume | r, keys, runs, queue depths, lease |

Callers name the part: `store.runs.create_run(spec)`, `store.workers.heartbeat(...)`, `store.keys.k_round(...)`.
Intake (results, spot checks) lives in `coordinator.intake`. Errors are the `CoordinatorError` family
(coordinator.errors); the API maps them to HTTP statuses. Worker tokens are stored only as sha256 digests.
"""

from __future__ import annotations

import redis
from celery import Celery

from coordinator.blobs import BlobStore
from coordinator.celery_app import make_celery
from coordinator.dispatch import Dispatch, spot_check_selected
from coordinator.keys import Keys, redis_client_kwargs, results_stream_key
from coordinator.registry import WorkerRegistry
from coordinator.rounds import RoundStore
from coordinator.runs import RunStore
from coordinator.settings import CoordinatorSettings
from coordinator.shares import ShareBook
from coordinator.teachers import TeacherRuns

__all__ = ["Store", "redis_client_kwargs", "results_stream_key", "spot_check_selected"]


class Store:
    """Coordinator state on Redis. `settings.redis_url` holds state; the broker may be another URL.

    Attributes: settings, r (the state Redis client, decoded responses), celery, and the parts of the module
    table: keys, blobs, runs, dispatch, rounds, teachers, workers, shares.
    """

    def __init__(self, settings: CoordinatorSettings, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.r = redis.Redis.from_url(
            settings.redis_url, decode_responses=True, health_check_interval=30, **redis_client_kwargs()
        )
        self.celery = celery_app or make_celery(
            settings.worker_broker_url, visibility_timeout_s=settings.visibility_timeout_s
        )
        self.keys = Keys(settings.key_prefix, settings.queue_prefix)
        self.blobs = BlobStore(settings.blob_dir, settings.max_blob_bytes)
        self.runs = RunStore(self.r, self.keys, self.blobs)
        self.dispatch = Dispatch(self.r, self.keys, self.runs, self.celery, settings.broker_url)
        self.rounds = RoundStore(self.r, self.keys, self.runs, self.dispatch, self.blobs)
        self.teachers = TeacherRuns(self.r, self.keys, self.blobs)
        self.workers = WorkerRegistry(self.r, self.keys, settings, self.runs, self.teachers)
        # a new run's queue is granted to the workers' broker users before they are told to consume it
        self.runs.on_new_queue = self.teachers.on_new_queue = self.workers.grant_queue
        self.rounds.live_workers = self.workers.live_workers
        self.shares = ShareBook(self.r, self.keys, self.runs, self.dispatch.queue_depths, settings.lease_seconds,
                                settings.share_hysteresis_s)
        self.runs.on_new_run = self.shares.start_run
        self.workers.probe_queues = self.shares.queues_for  # each heartbeat's queues follow the runs' shares

    def spot_copy_placeable(self, run: str, rid: str, seed: int) -> bool:
        """Whether a copy of spot-checked `seed` can go to a worker that did not evaluate one of its held replicas:
        some live worker (active or draining) is not among them and, once workers heartbeat under shares
        (coordinator.shares), one of those is told to consume the run. False means a copy would only come back refused
        (`same_worker`) or wait for a worker that is not there: a run held to one worker by its share spot-checks
        nothing while that lasts, as a one-worker fleet (the copies are given up and counted, not re-sent)."""
        holders = self.dispatch.spot_holders(run, rid, seed)
        if not holders:
            return True
        on = self.shares.workers_on(run)  # under shares, only the workers told to consume the run can take it
        return self.workers.live_workers(exclude=holders) > 0 and (on is None or bool(on - holders))

    def ping(self) -> bool:
        """True if Redis answers."""
        return bool(self.r.ping())
