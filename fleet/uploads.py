"""How bytes reach the coordinator: `BlobSender` (content-addressed blobs, over HTTP or into a shared blob
directory) and `UploadQueue` (the one background thread on which publishes, ledger entries and rounds are sent,
in order). Both are parts of fleet.backend.CoordinatorBackend; neither knows about models or rounds.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from coordinator.blobs import BlobStore
from coordinator.client import CoordinatorClient
from wire.shards import ShardPlan

log = logging.getLogger("sparecycles.fleet")


class BlobSender:
    """Puts content-addressed blobs (sha256) where the coordinator reads them, each at most once per sender.

    Args:
        client: the coordinator's HTTP client (PUT /v1/blobs/{sha}, HEAD to probe a shared directory).
        blob_dir: the coordinator's blob directory when this process shares its file system (`up`, compose's
            `blobs` volume): shards are then written there (hashed while written, no fsync: versions are
            re-creatable) instead of sent over HTTP. At construction a random probe blob written there must be
            seen by `HEAD /v1/blobs/{sha}`; if it is not, or the directory cannot be written, `note` says so
            (and the log) and every blob goes over HTTP.
    Thread-safe for concurrent `store_shard` calls (the publisher's shard pool): the set of sent hashes only
    grows, and a blob sent twice by a race is a harmless idempotent PUT.
    """

    def __init__(self, client: CoordinatorClient, blob_dir: str | Path | None = None) -> None:
        self.client = client
        self.sent: set[str] = set()
        self.note = ""  # why a configured blob_dir is not used (empty: used, or none configured)
        self.local: BlobStore | None = self._shared_store(Path(blob_dir)) if blob_dir else None

    def upload(self, data: bytes) -> str:
        """PUT `data` unless sent already; returns its sha256 (hex)."""
        return self.put(hashlib.sha256(data).hexdigest(), data)

    def put(self, sha: str, body, nbytes: int | None = None) -> str:
        """PUT `body` (bytes, or a chunk callable of `nbytes`) as `sha` unless this sender sent it already."""
        if sha not in self.sent:
            self.client.put_blob(sha, body, nbytes)
            self.sent.add(sha)
        return sha

    def store_shard(self, plan: ShardPlan) -> str:
        """Write one shard into the shared blob_dir, or hash it and PUT it if the coordinator lacks it; returns its
        sha256. Nothing is copied: the stream reads the tensors. A failed local write (disk full, permissions)
        stops using blob_dir and sends this shard and the later ones over HTTP."""
        local = self.local
        if local is not None:
            try:
                sha, _ = local.put_chunks(plan.chunks(), fsync=False)
            except OSError as exc:
                self._no_shared_store(f"writing a shard into blob_dir {local.root} failed ({exc})")
            else:
                self.sent.add(sha)
                return sha
        return self.put(plan.sha256(), plan.chunks, plan.nbytes)

    def _shared_store(self, root: Path) -> BlobStore | None:
        """The BlobStore at `root` if it is the coordinator's blob directory, else None (and `note` says why).
        The test: a blob of 32 random bytes written there must be seen by `HEAD /v1/blobs/{sha}`; content the
        coordinator could hold already (a resumed run's shards) would pass the test without proving anything."""
        try:
            store = BlobStore(root)
            sha, _ = store.put(secrets.token_bytes(32) + b" sparecycles blob_dir probe", fsync=False)
        except OSError as exc:
            self._no_shared_store(f"blob_dir {root} cannot be written ({exc})")
            return None
        try:
            seen = self.client.has_blob(sha)
        finally:
            store.path(sha).unlink(missing_ok=True)
        if not seen:
            self._no_shared_store(f"blob_dir {root} is not the coordinator's blob directory (it does not see a "
                                  "blob written there)")
            return None
        return store

    def _no_shared_store(self, why: str) -> None:
        self.note = f"{why}; shards go over HTTP"
        log.warning(self.note)
        self.local = None


class UploadQueue:
    """Runs send jobs now (`background=False`) or in submission order on one background thread.

    Once a queued job failed, the jobs after it are not run (a round or ledger entry would name a version that
    was never registered): each raises RuntimeError from the first failure. An error is raised to the caller
    by the next `check`, `wait_until`, `flush` or `close`.
    """

    def __init__(self, background: bool) -> None:
        self._io = ThreadPoolExecutor(1, thread_name_prefix="publish") if background else None
        self._jobs: deque[Future] = deque()  # queued jobs in submission order
        self._broken: BaseException | None = None  # the first queued job's failure

    @property
    def background(self) -> bool:
        """True when jobs run on the background thread."""
        return self._io is not None

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` now, or queue it after every job queued before it."""
        if self._io is None:
            job()
            return

        def guarded() -> None:
            if self._broken is not None:
                raise RuntimeError("not sent: an earlier background upload failed") from self._broken
            try:
                job()
            except BaseException as exc:
                self._broken = exc
                raise

        self._jobs.append(self._io.submit(guarded))

    def check(self, wait_for: int | None = None) -> None:
        """Raise the first failed job's error; wait until at most `wait_for` jobs are pending (None: no wait)."""
        while self._jobs and (self._jobs[0].done() or (wait_for is not None and len(self._jobs) > wait_for)):
            self._jobs.popleft().result()

    def wait_oldest(self) -> None:
        """Wait for the oldest queued job (raising its error); RuntimeError if none is queued."""
        if not self._jobs:
            raise RuntimeError("no queued upload to wait for")
        self._jobs.popleft().result()

    def recover(self) -> list[BaseException]:
        """Wait for every queued job and forget their failures (returned, oldest first): what they sent is sent
        again by the caller (fleet.recovery, after the coordinator lost the run). Later jobs run again."""
        errors = []
        while self._jobs:
            exc = self._jobs.popleft().exception()
            if exc is not None:
                errors.append(exc)
        self._broken = None
        return errors

    def flush(self) -> None:
        """Wait for every queued job; raises the first one's error."""
        self.check(wait_for=0)

    def close(self, wait: bool = True) -> None:
        """Finish the queued jobs (raising the first one's error), or with `wait=False` cancel those not yet
        started; then stop the thread."""
        try:
            if self._io is not None and wait:
                self.flush()
        finally:
            if self._io is not None:
                self._io.shutdown(wait=wait, cancel_futures=not wait)
