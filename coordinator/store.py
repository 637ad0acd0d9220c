"""Redis-backed coordinator state: worker registry with leases, runs, versions, seed ledger, rounds.

The worker registry (leases, hashed tokens) is the `WorkerRegistry` mixin in `coordinator.registry`.
Keys are namespaced `{prefix}:{run}:...` with the run in braces (a Redis Cluster hash tag, so the
multi-key intake script touches one slot). Worker tokens are stored only as sha256 digests. Intake
(results, spot checks) lives in `coordinator.intake`. Errors are the `CoordinatorError` family (coordinator.errors);
the API maps them to HTTP statuses.
"""

from __future__ import annotations

import functools
import hashlib
import time

import redis
from celery import Celery

from coordinator.blobs import BlobStore
from coordinator.celery_app import make_celery, send_probe_tasks
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.messages import (
    ProbeRound,
    ProbeTask,
    RoundInfo,
    RunInfo,
    RunSpec,
    SeedLedgerEntry,
    VersionManifest,
)
from coordinator.registry import WorkerRegistry
from coordinator.settings import CoordinatorSettings


def spot_check_selected(run: str, round_id: str, seed: int, fraction: float) -> bool:
    """Deterministic spot-check choice: sha256("run/round/seed")[:8] / 2**64 < fraction.

    A pure function of its arguments (counter-based hashing, no RNG state), so intake can recompute it.
    """
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{run}/{round_id}/{seed}".encode()).digest()[:8], "big")
    return h < fraction * 2.0**64


@functools.cache
def redis_client_kwargs() -> dict:
    """Extra keyword arguments for every Redis client of the coordinator (sync and asyncio).

    redis-py >= 7 builds a `DriverInfo` per new connection, which reads the installed package metadata
    (importlib.metadata, ~3 ms of CPU). A burst of new pooled connections then stalls the event loop for
    hundreds of ms; one `DriverInfo` per process, passed to every client, removes that cost.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # older redis-py: no per-connection metadata lookup
        return {}
    return {"driver_info": DriverInfo()}


def results_stream_key(prefix: str, run: str) -> str:
    """Redis Stream of a run's accepted-result events (each entry has field `e`: a StreamEvent JSON)."""
    return f"{prefix}:{{{run}}}:results"


class Store(WorkerRegistry):
    """Coordinator state on Redis. `settings.redis_url` holds state; the broker may be another URL."""

    def __init__(self, settings: CoordinatorSettings, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.r = redis.Redis.from_url(
            settings.redis_url, decode_responses=True, health_check_interval=30, **redis_client_kwargs()
        )
        self.blobs = BlobStore(settings.blob_dir, settings.max_blob_bytes)
        self.celery = celery_app or make_celery(
            settings.worker_broker_url, visibility_timeout_s=settings.visibility_timeout_s
        )
        self.p = settings.key_prefix

    # ---- keys -------------------------------------------------------------------------------------
    def k_worker(self, wid: str) -> str:
        return f"{self.p}:w:{wid}"

    def k_run(self, run: str, *parts: str) -> str:
        return ":".join([f"{self.p}:{{{run}}}", *parts])

    def k_round(self, run: str, rid: str, *parts: str) -> str:
        return self.k_run(run, "rd", rid, *parts)

    def queue_for(self, run: str) -> str:
        """Celery queue of a run's probe tasks."""
        return f"{self.settings.queue_prefix}.{run}"

    def ping(self) -> bool:
        """True if Redis answers."""
        return bool(self.r.ping())

    # ---- runs, versions, ledger ---------------------------------------------------------------------
    def create_run(self, spec: RunSpec, now: float | None = None) -> RunInfo:
        """Create a run; re-posting the identical spec is a no-op, a different one raises Conflict."""
        key = self.k_run(spec.run, "run")
        body = spec.model_dump_json()
        created = self.r.hsetnx(key, "spec", body)
        if not created and self.r.hget(key, "spec") != body:
            raise Conflict(f"run {spec.run} exists with a different spec")
        if created:
            self.r.hset(
                key,
                mapping={
                    "created_at": time.time() if now is None else now,
                    "latest_version": -1,
                    "staleness": spec.staleness,
                    "canary": int(spec.canary is not None),
                },
            )
            self.r.sadd(f"{self.p}:runs", spec.run)
        return self.run_info(spec.run)

    def run_spec(self, run: str) -> RunSpec:
        """The spec of `run`; raises NotFound."""
        body = self.r.hget(self.k_run(run, "run"), "spec")
        if body is None:
            raise NotFound(f"unknown run {run}")
        return RunSpec.model_validate_json(body)

    def run_info(self, run: str) -> RunInfo:
        """Spec, queue, latest version and open rounds of `run`."""
        spec = self.run_spec(run)
        h = self.r.hgetall(self.k_run(run, "run"))
        return RunInfo(
            spec=spec,
            queue=self.queue_for(run),
            latest_version=int(h["latest_version"]),
            open_rounds=sorted(self.r.smembers(self.k_run(run, "rounds:open"))),
            created_at=float(h["created_at"]),
        )

    def queues(self) -> list[str]:
        """Celery queues of all runs (workers consume these)."""
        return sorted(self.queue_for(run) for run in self.r.smembers(f"{self.p}:runs"))

    def latest_version(self, run: str) -> int:
        """Newest version of a run (-1 if none)."""
        v = self.r.hget(self.k_run(run, "run"), "latest_version")
        if v is None:
            raise NotFound(f"unknown run {run}")
        return int(v)

    def _bump_latest(self, run: str, version: int) -> None:
        # A Lua max keeps concurrent publishers from moving latest_version backwards.
        self.r.eval(
            "local c = tonumber(redis.call('HGET', KEYS[1], 'latest_version'))"
            " if tonumber(ARGV[1]) > c then redis.call('HSET', KEYS[1], 'latest_version', ARGV[1]) end",
            1,
            self.k_run(run, "run"),
            version,
        )
        self._close_stale_rounds(run)

    def _close_stale_rounds(self, run: str) -> None:
        # Rounds older than the staleness bound can accept nothing more: closing them keeps the open set
        # (scanned by quarantine, listed in RunInfo) bounded over a long run.
        h = self.r.hmget(self.k_run(run, "run"), ["latest_version", "staleness"])
        latest, staleness = int(h[0]), int(h[1])
        for rid in self.r.smembers(self.k_run(run, "rounds:open")):
            v = self.r.hget(self.k_round(run, rid), "version")
            if v is not None and latest - int(v) > staleness:
                self.r.hset(self.k_round(run, rid), "state", "closed")
                self.r.srem(self.k_run(run, "rounds:open"), rid)

    def register_version(self, manifest: VersionManifest) -> VersionManifest:
        """Register a snapshot whose shards are all in the blob store with the stated sizes.

        Raises NotFound (unknown run), Invalid (missing shard or wrong size), Conflict (the version exists
        with another manifest). Identical re-registration is a no-op.
        """
        self.run_spec(manifest.run)
        for shard in manifest.shards:
            if not self.blobs.exists(shard.sha256):
                raise Invalid(
                    f"shard {shard.name} ({shard.sha256}) is not in the blob store; upload it first"
                )
            if self.blobs.size(shard.sha256) != shard.bytes:
                raise Invalid(
                    f"shard {shard.name} is {self.blobs.size(shard.sha256)} bytes, not {shard.bytes}"
                )
        body = manifest.model_dump_json()
        key = self.k_run(manifest.run, "versions")
        if (
            not self.r.hsetnx(key, str(manifest.version), body)
            and self.r.hget(key, str(manifest.version)) != body
        ):
            raise Conflict(f"version {manifest.version} of run {manifest.run} exists with another manifest")
        self._bump_latest(manifest.run, manifest.version)
        return manifest

    def get_version(self, run: str, version: int) -> VersionManifest:
        """The manifest of a snapshot version; raises NotFound."""
        body = self.r.hget(self.k_run(run, "versions"), str(version))
        if body is None:
            raise NotFound(f"run {run} has no snapshot for version {version}")
        return VersionManifest.model_validate_json(body)

    def list_versions(self, run: str) -> list[int]:
        """Snapshot versions of a run, ascending."""
        self.run_spec(run)
        return sorted(int(v) for v in self.r.hkeys(self.k_run(run, "versions")))

    def append_ledger(self, entry: SeedLedgerEntry) -> SeedLedgerEntry:
        """Append a pure-ZO step; `entry.parent` must be the run's latest version (linear history)."""
        self.run_spec(entry.run)
        key = self.k_run(entry.run, "ledger")
        body = entry.model_dump_json()
        existing = self.r.hget(key, str(entry.version))
        if existing is not None:
            if existing != body:
                raise Conflict(f"ledger entry {entry.version} exists with other content")
            return entry
        latest = self.latest_version(entry.run)
        if entry.parent != latest:
            raise Conflict(f"ledger entry parent {entry.parent} is not the latest version {latest}")
        if not self.r.hsetnx(key, str(entry.version), body):
            raise Conflict("concurrent ledger append; retry")
        self._bump_latest(entry.run, entry.version)
        return entry

    def ledger(self, run: str, since: int = -1, limit: int = 1000) -> list[SeedLedgerEntry]:
        """Ledger entries with version > `since`, ascending, at most `limit`."""
        self.run_spec(run)
        key = self.k_run(run, "ledger")
        versions = sorted(int(v) for v in self.r.hkeys(key) if int(v) > since)[:limit]
        bodies = self.r.hmget(key, [str(v) for v in versions]) if versions else []
        return [SeedLedgerEntry.model_validate_json(b) for b in bodies]

    # ---- rounds -------------------------------------------------------------------------------------
    def create_round(self, rnd: ProbeRound, now: float | None = None) -> tuple[RoundInfo, int]:
        """Open a round and publish its Celery tasks (primaries, then spot-check replicas).

        Idempotent: re-posting the same round returns its info without publishing again (unless the
        first attempt died before publishing). Raises NotFound (run), Invalid (unknown version, missing
        batch blob), Conflict (round id reused with other content). Returns (info, tasks sent by this call).
        """
        spec = self.run_spec(rnd.run)
        latest = self.latest_version(rnd.run)
        if rnd.version > latest:
            raise Invalid(f"version {rnd.version} is not published (latest is {latest})")
        if not self.blobs.exists(rnd.batch_sha256):
            raise Invalid(f"batch blob {rnd.batch_sha256} is not in the blob store; upload it first")
        if rnd.base_version is not None and rnd.base_version > latest:
            raise Invalid(f"base_version {rnd.base_version} is not published (latest is {latest})")
        key = self.k_round(rnd.run, rnd.round_id)
        if not self.r.hsetnx(key, "round", rnd.model_dump_json()):
            if self.r.hget(key, "round") != rnd.model_dump_json():
                raise Conflict(f"round {rnd.round_id} exists with other content")
            if self.r.hget(key, "published") == "1":
                return self.round_info(rnd.run, rnd.round_id), 0
            # A retry after a crash between recording and publishing: publish now (intake dedupes).
        spot = [
            s for s in rnd.seeds if spot_check_selected(rnd.run, rnd.round_id, s, spec.spot_check_fraction)
        ]
        k = spec.seeds_per_task
        tasks = [self.task_for(rnd, rnd.seeds[i : i + k], 0) for i in range(0, len(rnd.seeds), k)]
        tasks += [self.task_for(rnd, spot[i : i + k], 1) for i in range(0, len(spot), k)]
        pipe = self.r.pipeline()
        for i in range(0, len(rnd.seeds), 8192):
            pipe.sadd(
                self.k_round(rnd.run, rnd.round_id, "seeds"), *[str(s) for s in rnd.seeds[i : i + 8192]]
            )
        pipe.hset(
            key,
            mapping={
                "state": "open",
                "version": rnd.version,
                "n_seeds": len(rnd.seeds),
                "n_spot": len(spot),
                "done": 0,
                "tasks": len(tasks),
                "created_at": time.time() if now is None else now,
            },
        )
        pipe.sadd(self.k_run(rnd.run, "rounds:open"), rnd.round_id)
        pipe.sadd(self.k_run(rnd.run, "rounds"), rnd.round_id)
        pipe.execute()
        send_probe_tasks(self.celery, self.queue_for(rnd.run), [t.model_dump(mode="json") for t in tasks])
        self.r.hset(key, "published", 1)
        return self.round_info(rnd.run, rnd.round_id), len(tasks)

    @staticmethod
    def task_for(rnd: ProbeRound, seeds: list[int], replica: int) -> ProbeTask:
        """The task evaluating `seeds` of round `rnd` as replica `replica`."""
        return ProbeTask(
            run=rnd.run,
            round_id=rnd.round_id,
            version=rnd.version,
            batch_sha256=rnd.batch_sha256,
            eps=rnd.eps,
            distribution=rnd.distribution,
            seeds=seeds,
            want_clean=rnd.want_clean,
            replica=replica,
            kind=rnd.kind,
            base_version=rnd.base_version,
        )

    def get_round(self, run: str, rid: str) -> ProbeRound:
        """The round request as posted; raises NotFound."""
        body = self.r.hget(self.k_round(run, rid), "round")
        if body is None:
            raise NotFound(f"unknown round {rid} of run {run}")
        return ProbeRound.model_validate_json(body)

    def round_info(self, run: str, rid: str) -> RoundInfo:
        """Progress of a round: `done` counts seeds whose value reached the stream."""
        h = self.r.hgetall(self.k_round(run, rid))
        if "state" not in h:
            raise NotFound(f"unknown round {rid} of run {run}")
        return RoundInfo(
            run=run,
            round_id=rid,
            version=int(h["version"]),
            state=h["state"],
            n_seeds=int(h["n_seeds"]),
            n_spot_checks=int(h["n_spot"]),
            tasks_published=int(h["tasks"]),
            done=int(h["done"]),
        )

    def close_round(self, run: str, rid: str) -> RoundInfo:
        """Close a round: later results are counted `closed_round` and dropped."""
        self.get_round(run, rid)
        self.r.hset(self.k_round(run, rid), "state", "closed")
        self.r.srem(self.k_run(run, "rounds:open"), rid)
        return self.round_info(run, rid)

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting in each run's Celery queue (kombu's Redis transport keeps a list per queue)."""
        if self.settings.broker_url and not hasattr(self, "_broker"):
            self._broker = redis.Redis.from_url(self.settings.broker_url, **redis_client_kwargs())
        broker = self._broker if self.settings.broker_url else self.r
        runs = sorted(self.r.smembers(f"{self.p}:runs"))
        pipe = broker.pipeline()
        for run in runs:
            pipe.llen(self.queue_for(run))
        return dict(zip(runs, pipe.execute()))
