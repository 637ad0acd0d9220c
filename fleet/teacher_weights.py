"""A teacher's weights as coordinator blobs, as weight versions are delivered: for workers that cannot
read the teacher's folder.

`publish_teacher(client, teacher, run)` uploads each file of trainer.kd.teacher.teacher_files (config.json and the
weight files) as one content-addressed blob (`PUT /v1/blobs/{sha256}`; a blob the coordinator holds already is not
sent again) and registers the teacher run (`POST /v1/teachers`): every worker then consumes its queue.

`fetch_teacher(client, sha, root)` rebuilds the folder as root/sha from `GET /v1/teachers/{sha}` (the manifest) and
`GET /v1/blobs/{sha256}` per file: each file checked against its sha256 and size as it arrives, the whole folder
against teacher_sha256, in a temporary folder renamed into place (a worker killed mid-fetch leaves a `.partial-*`
folder that a later fetch removes after PARTIAL_STALE_S). Network calls carry the client's timeouts and retries.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

from coordinator.client import CoordinatorClient, CoordinatorHTTPError, CorruptBlobError
from trainer.kd.teacher import TeacherMismatchError, teacher_files, teacher_sha256
from wire.teacher_messages import TeacherFile, TeacherManifest, TeacherRun

PARTIAL_STALE_S = 3600.0  # a .partial folder this old belongs to a fetch that died: removed by the next fetch
CHUNK_BYTES = 4 << 20  # a file is read and sent in chunks of this many bytes


class TeacherUnavailable(LookupError):
    """The coordinator holds no usable copy of the teacher: not registered, or a file missing or corrupt."""


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _chunks(path: Path):
    """A fresh iterable of `path`'s chunks per call (CoordinatorClient.put_blob retries with a new one)."""
    def read():
        with path.open("rb") as fh:
            yield from iter(lambda: fh.read(CHUNK_BYTES), b"")
    return read


def publish_teacher(client: CoordinatorClient, teacher: str, run: str) -> tuple[TeacherManifest, int]:
    """Upload `teacher` (a preset or a transformers folder) as blobs and register the teacher run `run` with an
    admin `client`; returns (its manifest, bytes uploaded: 0 when every file was there). Raises
    TeacherMismatchError for a folder that is not a teacher and CoordinatorHTTPError when the coordinator refuses."""
    files, sent = [], 0
    for path in teacher_files(teacher):
        f = TeacherFile(name=path.name, size=path.stat().st_size, sha256=_file_sha256(path))
        if not client.has_blob(f.sha256):
            client.put_blob(f.sha256, _chunks(path), nbytes=f.size)
            sent += f.size
        files.append(f)
    manifest = TeacherManifest(teacher_sha256=teacher_sha256(teacher), files=files)
    client.register_teacher(TeacherRun(run=run, teacher=manifest))
    return manifest, sent


def _remove_stale_partials(root: Path, sha: str) -> None:
    for old in root.glob(f"{sha}.partial-*"):
        try:
            if time.time() - old.stat().st_mtime > PARTIAL_STALE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # another fetch removed it first


def _is_teacher(folder: Path, sha: str) -> bool:
    try:
        return folder.is_dir() and teacher_sha256(str(folder)) == sha
    except (TeacherMismatchError, OSError):
        return False


def fetch_teacher(client: CoordinatorClient, sha: str, root: Path) -> tuple[Path, int]:
    """The folder of the registered teacher `sha` under `root` (root/sha): (path, bytes fetched: 0 when a verified
    copy was already there). Raises TeacherUnavailable when the coordinator has no such teacher or a file is
    missing or arrives corrupt (nothing is left in place then); httpx errors for a coordinator that does not
    answer."""
    final = root / sha
    if _is_teacher(final, sha):
        return final, 0
    try:
        manifest = client.teacher_manifest(sha)
    except CoordinatorHTTPError as exc:
        raise TeacherUnavailable(f"teacher {sha[:12]} is not registered at the coordinator ({exc.status})") from None
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, sha)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{sha}.partial-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the teacher from this machine's other users (a shared cache)
    try:
        for f in manifest.files:
            buf = bytearray(f.size)
            try:
                client.download_blob_into(f.sha256, memoryview(buf))
            except (CoordinatorHTTPError, CorruptBlobError) as exc:
                raise TeacherUnavailable(f"teacher file {f.name} ({f.sha256[:12]}): {str(exc)[:200]}") from None
            (tmp / f.name).write_bytes(buf)
        if not _is_teacher(tmp, sha):
            raise TeacherUnavailable(f"teacher {sha[:12]} rebuilt from the coordinator's blobs has another sha256")
        shutil.rmtree(final, ignore_errors=True)  # a copy that failed verification above
        try:
            tmp.rename(final)
        except OSError:  # another fetch on this machine put its (verified) copy there first
            if not _is_teacher(final, sha):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, manifest.nbytes
