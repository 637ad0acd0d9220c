"""Content-addressed blob store on a local directory (safetensors shards, probe batches).

A blob lives at `root/ab/abcdef...` named by the sha256 of its bytes. Writes go to a temporary file in
the same directory, are hashed while streaming, verified against the claimed hash, fsynced and renamed
into place, so a reader never sees a partial or corrupt blob.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobError(ValueError):
    """A blob was refused: hash mismatch, oversize, or a malformed hash."""


class BlobStore:
    """Local content-addressed store. `root` is created if missing; `max_bytes` caps one blob."""

    def __init__(self, root: Path, max_bytes: int = 8 << 30) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def path(self, sha256: str) -> Path:
        """Path of the blob named `sha256` (64 lowercase hex). Raises BlobError on a malformed name."""
        if not _SHA_RE.match(sha256):
            raise BlobError("a blob name is 64 lowercase hex characters (its sha256)")
        return self.root / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        """True if the blob is stored."""
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        """Size in bytes. Raises FileNotFoundError if absent."""
        return self.path(sha256).stat().st_size

    def writer(self, expected_sha256: str | None = None, fsync: bool = True) -> BlobWriter:
        """An incremental writer (for streamed uploads); see `BlobWriter`."""
        if expected_sha256 is not None:
            self.path(expected_sha256)  # validates the format before reading a byte
        return BlobWriter(self, expected_sha256, fsync)

    def put_chunks(self, chunks: Iterable[bytes], expected_sha256: str | None = None,
                   fsync: bool = True) -> tuple[str, int]:
        """Store a blob from byte chunks (bytes or memoryviews); return (sha256, size in bytes).

        fsync=False skips flushing the file to the disk before the rename: readers on this host see the same
        bytes at once, but a power loss can lose the blob (for re-creatable data: a trainer's weight versions).
        Raises BlobError if the content hash differs from `expected_sha256` or exceeds `max_bytes`;
        nothing is stored then. Storing existing content again is a no-op.
        """
        w = self.writer(expected_sha256, fsync)
        try:
            for chunk in chunks:
                w.write(chunk)
            return w.commit()
        finally:
            w.abort()

    def put(self, data: bytes, expected_sha256: str | None = None, fsync: bool = True) -> tuple[str, int]:
        """Store `data`; see `put_chunks`."""
        return self.put_chunks([data], expected_sha256, fsync)

    def get(self, sha256: str) -> bytes:
        """Read a whole blob, re-verifying its hash. Raises FileNotFoundError or BlobError (corrupt)."""
        data = self.path(sha256).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise BlobError(f"stored blob {sha256} is corrupt")
        return data

    def iter_names(self) -> Iterator[str]:
        """Names of all stored blobs."""
        for p in self.root.glob("??/*"):
            if _SHA_RE.match(p.name):
                yield p.name


class BlobWriter:
    """Streams bytes into a temporary file while hashing; `commit()` verifies and renames into place.

    Always call `abort()` (a no-op after a successful commit) in a `finally`.
    """

    def __init__(self, store: BlobStore, expected_sha256: str | None, fsync: bool = True) -> None:
        self.store, self.expected, self.fsync = store, expected_sha256, fsync
        self.digest = hashlib.sha256()
        self.size = 0
        fd, self.tmp = tempfile.mkstemp(prefix=".incoming-", dir=store.root)
        self.f = os.fdopen(fd, "wb")

    def write(self, chunk: bytes) -> None:
        """Append bytes. Raises BlobError once the total exceeds the store's `max_bytes`."""
        self.size += len(chunk)
        if self.size > self.store.max_bytes:
            raise BlobError(f"blob exceeds the limit of {self.store.max_bytes} bytes")
        self.digest.update(chunk)
        self.f.write(chunk)

    def commit(self) -> tuple[str, int]:
        """Verify the hash, fsync and move into place; return (sha256, size in bytes)."""
        self.f.flush()
        if self.fsync:
            os.fsync(self.f.fileno())
        self.f.close()
        sha = self.digest.hexdigest()
        if self.expected is not None and sha != self.expected:
            raise BlobError(f"content sha256 {sha} does not match the claimed {self.expected}")
        dest = self.store.path(sha)
        dest.parent.mkdir(exist_ok=True)
        os.chmod(self.tmp, 0o644)  # mkstemp makes 0600; a worker of another uid may read a shared store
        os.replace(self.tmp, dest)
        return sha, self.size

    def abort(self) -> None:
        """Discard the temporary file if it is still there."""
        if not self.f.closed:
            self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)
