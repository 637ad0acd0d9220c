"""Teacher runs: the runs whose teacher rounds the fleet's workers answer, registered at the coordinator
(a part of `coordinator.store.Store`, built with the state Redis client, the key layout and the blob store).

A trainer (or `sparecycles up`) uploads the teacher's files as blobs and registers `TeacherRun(run, teacher)`;
every worker then finds `teacher_queue(run)` in its registration's and heartbeats' `teacher_queues`, and fetches
the teacher's files by `GET /v1/teachers/{sha256}` (the manifest) and `GET /v1/blobs/{sha256}` (each file), as a
weight version's shards are fetched. Keys: `{p}:teachers` (hash run -> TeacherRun JSON) and `{p}:teacher:{sha}`
(the TeacherManifest JSON).
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from coordinator.blobs import BlobStore
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.keys import Keys
from wire.teacher_messages import TeacherManifest, TeacherRun, teacher_queue


class TeacherRuns:
    """Teacher runs and their teachers' manifests on Redis. `on_new_queue(queue)` (set by Store: the workers'
    broker users are granted it) runs before a new run's queue is listed to workers."""

    def __init__(self, r: redis.Redis, keys: Keys, blobs: BlobStore) -> None:
        self.r, self.keys, self.blobs = r, keys, blobs
        self.on_new_queue: Callable[[str], None] = lambda queue: None

    @property
    def k_runs(self) -> str:
        """Hash run -> TeacherRun JSON of the registered teacher runs."""
        return f"{self.keys.p}:teachers"

    def k_manifest(self, sha: str) -> str:
        """The TeacherManifest JSON of the teacher `sha`."""
        return f"{self.keys.p}:teacher:{sha}"

    def register(self, body: TeacherRun) -> TeacherRun:
        """Register a teacher run whose files are all blobs of the stated sizes. Re-registering the same run with
        the same teacher is a no-op. Raises Invalid (a file not in the blob store, or another size), Conflict (the
        run is registered with another teacher)."""
        for f in body.teacher.files:
            if not self.blobs.exists(f.sha256) or self.blobs.size(f.sha256) != f.size:
                raise Invalid(f"teacher file {f.name} ({f.sha256[:12]}, {f.size} bytes) is not in the blob store "
                              "with that size; upload it first")
        old = self.r.hget(self.k_runs, body.run)
        if old is not None:
            if TeacherRun.model_validate_json(old).teacher.teacher_sha256 != body.teacher.teacher_sha256:
                raise Conflict(f"teacher run {body.run} is registered with another teacher")
            return body
        self.r.set(self.k_manifest(body.teacher.teacher_sha256), body.teacher.model_dump_json())
        self.on_new_queue(teacher_queue(body.run))  # granted before any worker is told to consume it
        self.r.hset(self.k_runs, body.run, body.model_dump_json())
        return body

    def end(self, run: str) -> bool:
        """Take `run`'s queue off the list workers consume; False when it was not registered."""
        return bool(self.r.hdel(self.k_runs, run))

    def queues(self) -> list[str]:
        """The teacher queues of the registered runs, sorted."""
        return sorted(teacher_queue(run) for run in self.r.hkeys(self.k_runs))

    def manifest(self, sha: str) -> TeacherManifest:
        """The manifest of the registered teacher `sha`; raises NotFound."""
        body = self.r.get(self.k_manifest(sha))
        if body is None:
            raise NotFound(f"no teacher {sha[:12]} is registered")
        return TeacherManifest.model_validate_json(body)
