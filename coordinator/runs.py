"""Runs, snapshot versions and the pure-ZO seed ledger (a part of `coordinator.store.Store`, built with the
state Redis client, the key layout and the blob store it checks shards in).
Keys: `{p}:{run}:run` (hash: spec, latest_version, staleness, canary, created_at), `{p}:{run}:versions`
(hash version -> manifest), `{p}:{run}:ledger` (hash version -> entry), `{p}:runs` (set).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from coordinator.blobs import BlobStore
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.keys import Keys
from wire.messages import IntakeCounts, RunInfo, RunSpec, SeedLedgerEntry, VersionManifest
from wire.staleness import is_stale


class RunStore:
    """Run records, versions and ledger on Redis."""

    def __init__(self, r: redis.Redis, keys: Keys, blobs: BlobStore) -> None:
        self.r, self.keys, self.blobs = r, keys, blobs
        self.on_new_queue: Callable[[str], None] = lambda queue: None  # Store: granted to the workers' broker users
        self.on_new_run: Callable[[str, float], None] = lambda run, share: None  # Store: the run's share recorded

    def queues(self) -> list[str]:
        """Celery queues of all runs (workers consume these)."""
        return sorted(self.keys.queue_for(run) for run in self.r.smembers(self.keys.k_runs))

    def create_run(self, spec: RunSpec, now: float | None = None) -> RunInfo:
        """Create a run; re-posting the identical spec is a no-op, a different one raises Conflict."""
        key = self.keys.k_run(spec.run, "run")
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
            self.on_new_queue(self.keys.queue_for(spec.run))  # before any worker is told to consume it
            self.on_new_run(spec.run, spec.share)  # its share and virtual-time base, before a heartbeat lists it
            self.r.sadd(self.keys.k_runs, spec.run)
        return self.run_info(spec.run)

    def end_run(self, run: str) -> int:
        """End `run`: close every open round (later results are counted `closed_round`, nothing is re-dispatched)
        and take its queue off the list workers consume (`queues`), so they stop within one control interval.
        Idempotent; the run's record, versions and stream stay readable. Returns the rounds closed. Raises
        NotFound for an unknown run."""
        self.run_spec(run)
        open_key = self.keys.k_run(run, "rounds:open")
        closed = 0
        for rid in self.r.smembers(open_key):
            self.r.hset(self.keys.k_round(run, rid), "state", "closed")
            self.r.srem(open_key, rid)
            closed += 1
        self.r.srem(self.keys.k_runs, run)
        return closed

    def run_spec(self, run: str) -> RunSpec:
        """The spec of `run`; raises NotFound."""
        body = self.r.hget(self.keys.k_run(run, "run"), "spec")
        if body is None:
            raise NotFound(f"unknown run {run}")
        return RunSpec.model_validate_json(body)

    def run_info(self, run: str) -> RunInfo:
        """Spec, queue, latest version and open rounds of `run`."""
        spec = self.run_spec(run)
        h = self.r.hgetall(self.keys.k_run(run, "run"))
        return RunInfo(
            spec=spec,
            queue=self.keys.queue_for(run),
            latest_version=int(h["latest_version"]),
            open_rounds=sorted(self.r.smembers(self.keys.k_run(run, "rounds:open"))),
            created_at=float(h["created_at"]),
        )

    def intake_counts(self, run: str) -> IntakeCounts:
        """Results of `run` intake refused as stale or duplicate so far (counted by the intake script)."""
        h = self.r.hmget(self.keys.k_run(run, "run"), ["spec", "n_stale", "n_duplicate"])
        if h[0] is None:
            raise NotFound(f"unknown run {run}")
        return IntakeCounts(run=run, stale=int(h[1] or 0), duplicate=int(h[2] or 0))

    def latest_version(self, run: str) -> int:
        """Newest version of a run (-1 if none): one HGET (the long poll of GET /v1/runs/{run} reads it). Raises
        NotFound."""
        v = self.r.hget(self.keys.k_run(run, "run"), "latest_version")
        if v is None:
            raise NotFound(f"unknown run {run}")
        return int(v)

    def _bump_latest(self, run: str, version: int) -> None:
        # A Lua max keeps concurrent publishers from moving latest_version backwards.
        self.r.eval(
            "local c = tonumber(redis.call('HGET', KEYS[1], 'latest_version'))"
            " if tonumber(ARGV[1]) > c then redis.call('HSET', KEYS[1], 'latest_version', ARGV[1]) end",
            1,
            self.keys.k_run(run, "run"),
            version,
        )
        self._close_stale_rounds(run)

    def _close_stale_rounds(self, run: str) -> None:
        # Rounds older than the staleness bound can accept nothing more: closing them keeps the open set
        # (scanned by quarantine, listed in RunInfo) bounded over a long run.
        h = self.r.hmget(self.keys.k_run(run, "run"), ["latest_version", "staleness"])
        latest, staleness = int(h[0]), int(h[1])
        for rid in self.r.smembers(self.keys.k_run(run, "rounds:open")):
            v = self.r.hget(self.keys.k_round(run, rid), "version")
            if v is not None and is_stale(int(v), latest, staleness):
                self.r.hset(self.keys.k_round(run, rid), "state", "closed")
                self.r.srem(self.keys.k_run(run, "rounds:open"), rid)

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
        key = self.keys.k_run(manifest.run, "versions")
        if (
            not self.r.hsetnx(key, str(manifest.version), body)
            and self.r.hget(key, str(manifest.version)) != body
        ):
            raise Conflict(f"version {manifest.version} of run {manifest.run} exists with another manifest")
        self._bump_latest(manifest.run, manifest.version)
        return manifest

    def get_version(self, run: str, version: int) -> VersionManifest:
        """The manifest of a snapshot version; raises NotFound."""
        body = self.r.hget(self.keys.k_run(run, "versions"), str(version))
        if body is None:
            raise NotFound(f"run {run} has no snapshot for version {version}")
        return VersionManifest.model_validate_json(body)

    def list_versions(self, run: str) -> list[int]:
        """Snapshot versions of a run, ascending."""
        self.run_spec(run)
        return sorted(int(v) for v in self.r.hkeys(self.keys.k_run(run, "versions")))

    def append_ledger(self, entry: SeedLedgerEntry) -> SeedLedgerEntry:
        """Append a pure-ZO step; `entry.parent` must be the run's latest version (linear history)."""
        self.run_spec(entry.run)
        key = self.keys.k_run(entry.run, "ledger")
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
        key = self.keys.k_run(run, "ledger")
        versions = sorted(int(v) for v in self.r.hkeys(key) if int(v) > since)[:limit]
        bodies = self.r.hmget(key, [str(v) for v in versions]) if versions else []
        return [SeedLedgerEntry.model_validate_json(b) for b in bodies]
