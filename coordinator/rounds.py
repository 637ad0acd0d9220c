"""Probe rounds: opening (recording seeds, publishing tasks), progress and closing (a part of
`coordinator.store.Store`, built with the state Redis client, the key layout, the runs, the task dispatch
and the blob store batches are checked in).

Keys: `{p}:{run}:rd:{rid}` (hash: round document, state, version, n_seeds, n_spot, done, tasks,
created_at, published), `{p}:{run}:rd:{rid}:seeds` (set), `{p}:{run}:rounds` and `:rounds:open` (sets).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from coordinator.blobs import BlobStore
from coordinator.dispatch import Dispatch, spot_check_selected
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.keys import Keys
from coordinator.runs import RunStore
from wire.round_messages import ProbeRound, RoundInfo


class RoundStore:
    """Round records on Redis (publishing goes through `Dispatch`)."""

    def __init__(self, r: redis.Redis, keys: Keys, runs: RunStore, dispatch: Dispatch, blobs: BlobStore) -> None:
        self.r, self.keys, self.runs, self.dispatch, self.blobs = r, keys, runs, dispatch, blobs
        # Workers able to take tasks (coordinator.registry.WorkerRegistry.live_workers, set by Store); None: unknown
        self.live_workers: Callable[[], int] | None = None

    def create_round(self, rnd: ProbeRound, now: float | None = None) -> tuple[RoundInfo, int]:
        """Open a round and publish its Celery tasks (primaries, then spot-check replicas).

        Idempotent: re-posting the same round returns its info without publishing again (unless the
        first attempt died before publishing). Raises NotFound (run), Invalid (unknown version, missing
        batch blob), Conflict (round id reused with other content). Returns (info, tasks sent by this call).
        """
        spec = self.runs.run_spec(rnd.run)
        latest = self.runs.latest_version(rnd.run)
        if rnd.version > latest:
            raise Invalid(f"version {rnd.version} is not published (latest is {latest})")
        if not self.blobs.exists(rnd.batch_sha256):
            raise Invalid(f"batch blob {rnd.batch_sha256} is not in the blob store; upload it first")
        if rnd.base_version is not None and rnd.base_version > latest:
            raise Invalid(f"base_version {rnd.base_version} is not published (latest is {latest})")
        key = self.keys.k_round(rnd.run, rnd.round_id)
        if not self.r.hsetnx(key, "round", rnd.model_dump_json()):
            if self.r.hget(key, "round") != rnd.model_dump_json():
                raise Conflict(f"round {rnd.round_id} exists with other content")
            if self.r.hget(key, "published") == "1":
                return self.round_info(rnd.run, rnd.round_id), 0
            # A retry after a crash between recording and publishing: publish now (intake dedupes).
        spot = [
            s for s in rnd.seeds if spot_check_selected(rnd.run, rnd.round_id, s, spec.spot_check_fraction)
        ]
        dropped = 0
        if spot and self.live_workers is not None and self.live_workers() == 1:
            # One live worker: a second replica could only come back to it (intake refuses that as `same_worker`).
            # The round is opened without spot checks (its seeds plain), counted; none live: the copies wait.
            dropped, spot = len(spot), []
        tasks = self.dispatch.tasks_for(rnd, rnd.seeds, 0) + self.dispatch.tasks_for(rnd, spot, 1)
        pipe = self.r.pipeline()
        for i in range(0, len(rnd.seeds), 8192):
            pipe.sadd(
                self.keys.k_round(rnd.run, rnd.round_id, "seeds"), *[str(s) for s in rnd.seeds[i : i + 8192]]
            )
        pipe.hset(
            key,
            mapping={
                "state": "open",
                "version": rnd.version,
                "n_seeds": len(rnd.seeds),
                "n_spot": len(spot),
                "spot_dropped": dropped,
                "done": 0,
                "tasks": len(tasks),
                "created_at": time.time() if now is None else now,
            },
        )
        pipe.sadd(self.keys.k_run(rnd.run, "rounds:open"), rnd.round_id)
        pipe.sadd(self.keys.k_run(rnd.run, "rounds"), rnd.round_id)
        pipe.execute()
        self.dispatch.publish_tasks(rnd.run, tasks)
        self.r.hset(key, "published", 1)
        return self.round_info(rnd.run, rnd.round_id), len(tasks)

    def spot_dropped(self, run: str, rid: str) -> int:
        """Spot-check copies round `rid` was opened without (one live worker at its opening), 0 if none."""
        return int(self.r.hget(self.keys.k_round(run, rid), "spot_dropped") or 0)

    def get_round(self, run: str, rid: str) -> ProbeRound:
        """The round request as posted; raises NotFound."""
        body = self.r.hget(self.keys.k_round(run, rid), "round")
        if body is None:
            raise NotFound(f"unknown round {rid} of run {run}")
        return ProbeRound.model_validate_json(body)

    def round_info(self, run: str, rid: str) -> RoundInfo:
        """Progress of a round: `done` counts seeds whose value reached the stream."""
        h = self.r.hgetall(self.keys.k_round(run, rid))
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
        self.r.hset(self.keys.k_round(run, rid), "state", "closed")
        self.r.srem(self.keys.k_run(run, "rounds:open"), rid)
        return self.round_info(run, rid)
