"""A teacher's weights published once into the store, for teacher workers that cannot read its folder (issue 36).

`publish_teacher(store, teacher)` writes each file of trainer.kd.teacher.teacher_files (config.json and the weight
files) as content-addressed parts of at most TEACHER_PART_BYTES bytes (wire.teacher_messages.teacher_part_key),
then the TeacherManifest under teacher_manifest_key(sha): parts first, so a manifest never names a part not yet
stored. Published once: a later call finds the manifest and its parts and only refreshes their TTL (TEACHER_TTL_S);
a part gone (evicted, expired, truncated) is written again, and a worker that finds a part corrupt deletes it so
the next publish writes it again. A store with a memory limit too tight for the teacher (its weights above half the
free memory: queues and targets need the rest) is not written at all, and a publish the store refuses midway takes
back the parts it wrote: a full store never keeps half a teacher.

`fetch_teacher(store, sha, root)` rebuilds the folder as root/sha: each part checked against its sha256 and size,
each file against its sha256, the whole folder against teacher_sha256, in a temporary folder renamed into place
(a worker killed mid-fetch leaves a `.partial-*` folder that a later fetch removes after PARTIAL_STALE_S). Network
calls carry the Redis client's timeouts.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import redis
from pydantic import ValidationError

from trainer.kd.teacher import TeacherMismatchError, teacher_files, teacher_sha256
from wire.teacher_messages import (
    TEACHER_PART_BYTES,
    TEACHER_TTL_S,
    TeacherFile,
    TeacherManifest,
    TeacherPart,
    teacher_manifest_key,
    teacher_part_key,
)

PARTIAL_STALE_S = 3600.0  # a .partial folder this old belongs to a fetch that died: removed by the next fetch
FREE_SHARE = 0.5  # a teacher is published only into at most this share of a memory-limited store's free memory


class TeacherUnavailable(LookupError):
    """The store holds no usable copy of the teacher: no manifest, an invalid one, or a part missing or corrupt."""


def _manifest(store: redis.Redis, sha: str) -> TeacherManifest | None:
    raw = store.get(teacher_manifest_key(sha))
    if raw is None:
        return None
    try:
        manifest = TeacherManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise TeacherUnavailable(f"teacher {sha[:12]}'s manifest in the store is invalid: {str(exc)[:200]}") from None
    if manifest.teacher_sha256 != sha:
        raise TeacherUnavailable(f"the manifest under teacher {sha[:12]} names {manifest.teacher_sha256[:12]}")
    return manifest


def _refresh(store: redis.Redis, manifest: TeacherManifest, ttl_s: int) -> bool:
    """Extend the TTL of the manifest and every part; False when a part is gone (then publish again)."""
    parts = [p for f in manifest.files for p in f.parts]
    pipe = store.pipeline(transaction=False)
    for part in parts:
        pipe.expire(teacher_part_key(part.sha256), ttl_s)
        pipe.strlen(teacher_part_key(part.sha256))
    got = pipe.execute()
    if not all(got[0::2]) or any(n != p.size for n, p in zip(got[1::2], parts, strict=True)):
        return False
    return bool(store.expire(teacher_manifest_key(manifest.teacher_sha256), ttl_s))


def _check_room(store: redis.Redis, nbytes: int) -> None:
    """Raise redis.exceptions.OutOfMemoryError when the store has a memory limit (maxmemory) and `nbytes` exceed
    FREE_SHARE of its free memory. A store that does not say (no limit, INFO not allowed to this user) passes."""
    try:
        info = store.info("memory")
    except redis.ResponseError:  # an ACL user without INFO: the store's own limit still refuses a write
        return
    limit, used = int(info.get("maxmemory", 0)), int(info.get("used_memory", 0))
    if limit and nbytes > FREE_SHARE * (limit - used):
        raise redis.exceptions.OutOfMemoryError(
            f"the teacher's {nbytes / 2**20:.1f} MiB would take more than {FREE_SHARE:.0%} of the store's free "
            f"{max(0, limit - used) / 2**20:.1f} MiB (maxmemory {limit / 2**20:.1f} MiB): not published")


def publish_teacher(store: redis.Redis, teacher: str, *, part_bytes: int = TEACHER_PART_BYTES,
                    ttl_s: int = TEACHER_TTL_S) -> tuple[TeacherManifest, int]:
    """Publish `teacher` (a preset or a transformers folder: trainer.kd.teacher.teacher_folder) into `store`;
    returns (its manifest, bytes written: 0 when it was already there). Raises ValueError for part_bytes outside
    [1, TEACHER_PART_BYTES] or ttl_s < 1, TeacherMismatchError for a folder that is not a teacher, and
    redis.RedisError when the store refuses (e.g. maxmemory): the caller decides whether workers can do without."""
    if not 1 <= part_bytes <= TEACHER_PART_BYTES or ttl_s < 1:
        raise ValueError(f"part_bytes {part_bytes} in [1, {TEACHER_PART_BYTES}] and ttl_s {ttl_s} >= 1")
    sha = teacher_sha256(teacher)
    try:
        found = _manifest(store, sha)
    except TeacherUnavailable:
        found = None  # an invalid manifest is overwritten below
    if found is not None and _refresh(store, found, ttl_s):
        return found, 0
    paths = teacher_files(teacher)
    _check_room(store, sum(path.stat().st_size for path in paths))
    files, mine = [], []  # mine: the parts this call wrote, taken back if the store refuses a later one
    try:
        for path in paths:
            files.append(_publish_file(store, path, part_bytes, ttl_s, mine))
        manifest = TeacherManifest(teacher_sha256=sha, files=files)
        store.set(teacher_manifest_key(sha), manifest.model_dump_json(), ex=ttl_s)
    except redis.RedisError:
        if mine:
            try:
                store.delete(*(teacher_part_key(p.sha256) for p in mine))
            except redis.RedisError:
                pass  # their TTL ends them
        raise
    return manifest, sum(p.size for p in mine)


def _publish_file(store: redis.Redis, path: Path, part_bytes: int, ttl_s: int, mine: list[TeacherPart]) -> TeacherFile:
    """Write one file's parts (those not already stored: an earlier publish, or an equal part of another teacher,
    only get their TTL refreshed; a stored part of the wrong length is replaced); appends to `mine` the parts written."""
    parts, whole = [], hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(part_bytes), b""):
            whole.update(chunk)
            part = TeacherPart(sha256=hashlib.sha256(chunk).hexdigest(), size=len(chunk))
            key = teacher_part_key(part.sha256)
            if store.strlen(key) != part.size and store.set(key, chunk, ex=ttl_s):
                mine.append(part)
            else:
                store.expire(key, ttl_s)
            parts.append(part)
    return TeacherFile(name=path.name, size=sum(p.size for p in parts), sha256=whole.hexdigest(), parts=parts)


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


def fetch_teacher(store: redis.Redis, sha: str, root: Path) -> tuple[Path, int]:
    """The folder of the published teacher `sha` under `root` (root/sha): (path, bytes fetched: 0 when a verified
    copy was already there). Raises TeacherUnavailable when the store holds no manifest for `sha`, an invalid one,
    or a part missing or not matching its sha256 (nothing is left in place then), and redis.RedisError for a store
    that does not answer."""
    final = root / sha
    if _is_teacher(final, sha):
        return final, 0
    manifest = _manifest(store, sha)
    if manifest is None:
        raise TeacherUnavailable(f"teacher {sha[:12]} is not published in the store")
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root, sha)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{sha}.partial-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the teacher from this machine's other users (a shared cache)
    try:
        for f in manifest.files:
            _fetch_file(store, f, tmp / f.name)
        if not _is_teacher(tmp, sha):
            raise TeacherUnavailable(f"teacher {sha[:12]} rebuilt from the store has another sha256")
        shutil.rmtree(final, ignore_errors=True)  # a copy that failed verification above
        try:
            tmp.rename(final)
        except OSError:  # another fetch on this machine put its (verified) copy there first
            if not _is_teacher(final, sha):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, manifest.nbytes


def _fetch_file(store: redis.Redis, f: TeacherFile, dest: Path) -> None:
    whole = hashlib.sha256()
    with dest.open("wb") as out:
        for part in f.parts:
            data = store.get(teacher_part_key(part.sha256))
            if data is None or len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
                why = "missing" if data is None else "corrupt"
                if data is not None:  # content-addressed: wrong bytes under its sha256 are wrong for everyone;
                    store.delete(teacher_part_key(part.sha256))  # gone, the trainer's next publish writes it again
                raise TeacherUnavailable(f"teacher file {f.name}: part {part.sha256[:12]} is {why} in the store")
            out.write(data)
            whole.update(data)
    if whole.hexdigest() != f.sha256:
        raise TeacherUnavailable(f"teacher file {f.name} rebuilt from its parts has another sha256")
