"""Weight cache of a probe worker: content-addressed safetensors shards on disk, loaded versions in memory.

Shards live at `root/shards/ab/abcdef...` named by their sha256; a worker sharing the coordinator's file
system reads them in place from its blob directory instead (`shared_blob_dir`). Every use reads a shard once
into one buffer (pinned for a GPU), hashes it and parses tensors as views of it (wire.shards.parse_safetensors),
so nothing unverified is ever loaded and nothing is copied twice; a shard whose hash differs is deleted,
counted and fetched again. Only shards the worker lacks are downloaded, so a
version sharing shards with its parent costs only the changed ones. The newest `keep_versions` models
stay loaded; shards not referenced by the newest `keep_disk_versions` manifests are pruned from disk.

A version the coordinator has no snapshot for (404) is a pure-ZO seed-ledger version: it is rebuilt by
replaying ledger entries on the newest loaded version below it (or the newest snapshot when none is
loaded or it is more than `max_replay` entries behind), in fp32 with the kernels' replay.

Loads overlap with evaluation: a snapshot load reads nothing of the loaded models, so it runs
beside a task's evaluation; only a replay, which clones a loaded model's parameters, needs the caller's
evaluation lock (`WeightCache.get`'s `replay_lock`). The cache's own lock guards its dictionaries only,
never a load: a version already loaded is returned at once while another version loads, and a thread asking
for a version another thread is loading waits for that load (one load per version, see `get`).

Shard layout (written by `fleet.publisher.write_shards`): each shard holds some canonical
parameters (`model.named_parameters()` names, tied weights once); together they cover all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.client import CoordinatorClient, CoordinatorHTTPError, CorruptBlobError
from probe_kernels import replay_
from probe_worker.metrics import WorkerMetrics, default_metrics
from probe_worker.model_build import build_from_tensors  # noqa: F401  (public here too)
from trainer.paths import cache_dir
from wire.messages import ShardRef, VersionManifest
from wire.shards import parse_safetensors

log = logging.getLogger("sparecycles.worker")

SHARD_FETCH_TRIES = 3
SHARD_READ_THREADS = 8  # shards one snapshot load reads and hashes at once


class LoadStopped(Exception):
    """A weight load gave up because the worker is stopping (WeightCache.stopping): a snapshot load before its next
    shard (the shards already read stay cached on disk, the version is not loaded), a ledger replay before its next
    entry (the entries done are kept as their version)."""


class VersionUnavailable(LookupError):
    """The coordinator has neither a snapshot of a version nor a ledger path to it from one."""


@dataclass(frozen=True)
class LoadedVersion:
    """A version ready to probe: its manifest and the model (eval mode, on the cache's device)."""

    manifest: VersionManifest
    model: torch.nn.Module


class _Pending:
    """One in-flight load of a version: its waiters block on `done`, then read `loaded` or `error`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.loaded: LoadedVersion | None = None
        self.error: BaseException | None = None


class WeightCache:
    """Fetch, verify and load weight versions for one device; thread-safe.

    Args:
        client: coordinator client used to fetch manifests and blobs.
        root: cache folder (shards under `root/shards`); default `trainer.paths.cache_dir()/worker`.
        device: torch device the models are loaded onto.
        keep_versions: loaded models kept in memory (>= 1).
        keep_disk_versions: versions whose shards are kept on disk (>= keep_versions).
        metrics: where hits, misses, bytes, seconds and the current version are counted.
        shared_blob_dir: the coordinator's blob directory when this worker shares its file system (`up`,
            compose's `blobs` volume, read-only is enough): shards found there are read in place, not downloaded.
        max_replay: a pure-ZO version further than this many ledger entries from the newest loaded version
            is rebuilt from the newest snapshot instead (DESIGN.md: "fetch a snapshot when too far behind").
    """

    def __init__(self, client: CoordinatorClient, root: Path | None = None, device: str = "cpu",
                 keep_versions: int = 2, keep_disk_versions: int = 3, metrics: WorkerMetrics | None = None,
                 max_replay: int = 1000, shared_blob_dir: Path | None = None) -> None:
        if keep_versions < 1 or keep_disk_versions < keep_versions:
            raise ValueError("need keep_versions >= 1 and keep_disk_versions >= keep_versions")
        if root is None:
            root = cache_dir() / "worker"
        self.client, self.device = client, device
        self.shared_blob_dir = Path(shared_blob_dir) if shared_blob_dir else None
        self._pin = torch.device(device).type == "cuda"
        self.shard_dir = Path(root) / "shards"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.keep_versions, self.keep_disk_versions = keep_versions, keep_disk_versions
        self.max_replay = max_replay
        # called between the entries of a ledger replay (a serving worker's: raises while it yields): raising ends the
        # replay; the entries replayed so far are kept as their version, so the next replay goes on from there
        self.interrupt: Callable[[], None] = lambda: None
        # True where a replay can be cut inside an entry (a serving worker's chunk hook): each entry backs up the
        # tensors it changes (one model copy), so a cut puts them back and keeps the entries done
        self.interruptible = False
        # True once the worker is stopping (its warm shutdown began: SIGTERM): a snapshot load starts no further shard
        # and a ledger replay no further entry (LoadStopped), so the stop waits for the shards being read, not all
        self.stopping: Callable[[], bool] = lambda: False
        self.metrics = metrics or default_metrics()
        self._loaded: OrderedDict[tuple[str, int], LoadedVersion] = OrderedDict()
        self._recent: OrderedDict[tuple[str, int], VersionManifest] = OrderedDict()
        self._loading: dict[tuple[str, int], _Pending] = {}  # versions being loaded, by key
        self._reading: dict[tuple[str, int], VersionManifest] = {}  # snapshots whose shards are being read
        self._lock = threading.Lock()  # guards the dictionaries above and _loaded; never held during a load

    def has(self, run: str, version: int) -> bool:
        """True if (run, version) is loaded in memory (ready to probe without I/O)."""
        return (run, version) in self._loaded

    def shard_path(self, sha256: str) -> Path:
        """Where the shard named `sha256` is kept."""
        return self.shard_dir / sha256[:2] / sha256

    def _read(self, path: Path, size: int) -> torch.Tensor:
        """The file's bytes in one uint8 buffer (pinned for a CUDA device: its copy to the GPU is a DMA)."""
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf.numpy()), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptBlobError(f"{path} is shorter than its {size} bytes")
                got += n
            if f.read(1):
                raise CorruptBlobError(f"{path} is longer than its {size} bytes")
        return buf

    def _read_verified(self, path: Path, ref: ShardRef) -> tuple[torch.Tensor | None, bool]:
        """(the file's bytes if they hash to `ref`, else None; whether a file was there but wrong). A missing or
        unreadable file (pruned meanwhile, a directory this worker may not enter) is a plain miss."""
        try:
            buf = self._read(path, ref.bytes)
        except OSError:
            return None, False
        except CorruptBlobError:  # another size than the manifest's
            return None, True
        if hashlib.sha256(memoryview(buf.numpy())).hexdigest() != ref.sha256:
            return None, True
        return buf, False

    def _keep_on_disk(self, path: Path, buf: torch.Tensor) -> None:
        """Write a downloaded shard into the cache (atomically; no fsync: a lost file is fetched again)."""
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".part-", dir=path.parent)  # unique across worker processes
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(buf.numpy()))
            os.replace(tmp, path)
        except OSError as exc:  # a full disk costs the cache, not the version
            log.warning("shard %s not cached on disk: %s", path.name, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def shard_buffer(self, ref: ShardRef) -> torch.Tensor:
        """The verified bytes of one shard as a uint8 tensor (pinned for a CUDA device), read from the shared blob
        directory (`shared_blob_dir`), else from this worker's cache, else downloaded into the cache.

        Every buffer is hashed after it is read and before it is parsed (the parse reads this buffer, so nothing
        unverified is ever loaded); a download is hashed as it arrives into the buffer, then kept on disk. A
        corrupt cached copy is deleted and fetched again; a corrupt shared copy is skipped.
        Raises CorruptBlobError if SHARD_FETCH_TRIES downloads all arrive corrupt.
        """
        path = self.shard_path(ref.sha256)
        if self.shared_blob_dir is not None:
            buf, corrupt = self._read_verified(self.shared_blob_dir / ref.sha256[:2] / ref.sha256, ref)
            if buf is not None:
                self.metrics.cache_hits.labels("shared").inc()
                return buf
            if corrupt:
                self.metrics.corrupt.inc()
        buf, corrupt = self._read_verified(path, ref)
        if buf is not None:
            self.metrics.cache_hits.labels("shard").inc()
            return buf
        if corrupt:
            self.metrics.corrupt.inc()
            path.unlink(missing_ok=True)  # never load it; fetch a good copy instead
        buf = torch.empty(ref.bytes, dtype=torch.uint8, pin_memory=self._pin)
        for _ in range(SHARD_FETCH_TRIES):
            self.metrics.cache_misses.labels("shard").inc()
            try:
                self.client.download_blob_into(ref.sha256, memoryview(buf.numpy()))
            except CorruptBlobError:
                self.metrics.corrupt.inc()
                continue
            self.metrics.weight_bytes.inc(ref.bytes)
            self._keep_on_disk(path, buf)
            return buf  # hashed as it arrived: these are the verified bytes
        raise CorruptBlobError(f"shard {ref.name} ({ref.sha256}) arrived corrupt {SHARD_FETCH_TRIES} times")

    def get(self, run: str, version: int,
            replay_lock: contextlib.AbstractContextManager[Any] | None = None) -> LoadedVersion:
        """The loaded model of (run, version): from memory, else fetched, verified and loaded.

        The manifest fetch decides how it loads: a snapshot (the coordinator has its manifest) is loaded without
        any caller lock, so it overlaps with evaluations; a pure-ZO version (404) is replayed from a loaded model
        (`_replay`) inside `replay_lock`, the caller's evaluation lock when the caller does not hold it already
        (None: the caller excludes evaluations itself, e.g. a task calling from inside its evaluation).

        One load per version: a thread asking for a version another thread is loading waits for that load and
        gets its model (or its error); a version already loaded is returned at once, never behind a load of
        another version (the cache's lock is held only for dictionary updates). Loads of different versions may
        run at once. Timings (`weight_load_seconds`, the log line) are seconds of the thread that loaded.

        Raises VersionUnavailable (no snapshot and no ledger path), CoordinatorHTTPError, CorruptBlobError,
        or ValueError (the shards do not fit the manifest's model); a waiter raises the loader's error.
        """

        key = (run, version)
        found = self._lookup(key)
        if found is not None:
            return found
        t0 = time.perf_counter()
        try:
            manifest = self.client.version(run, version)
        except CoordinatorHTTPError as exc:
            if exc.status != 404:
                raise
            # a pure-ZO version: a seed-ledger entry, not a snapshot. The replay clones a loaded model's
            # parameters, which a probe perturbs in place during its forwards: so not during an evaluation.
            with replay_lock if replay_lock is not None else contextlib.nullcontext():
                loaded, mine = self._load(key, lambda: self._replay(run, version))
        else:
            loaded, mine = self._load(key, lambda: self._load_snapshot(run, version, manifest))
        if mine:
            dt = time.perf_counter() - t0
            self.metrics.weight_load_seconds.observe(dt)
            self.metrics.version.set(version)
            # unix time: benchmarks pair it with the trainer's publish time (publish -> ready per version)
            log.info("run %s version %d ready in %.3f s (unix %.3f)", run, version, dt, time.time())
        return loaded

    def _hit(self, key: tuple[str, int]) -> LoadedVersion | None:
        """The loaded version `key` (counted a hit, made the newest), or None; under self._lock."""
        if key not in self._loaded:
            return None
        self._loaded.move_to_end(key)
        self.metrics.cache_hits.labels("version").inc()
        return self._loaded[key]

    def _lookup(self, key: tuple[str, int]) -> LoadedVersion | None:
        """The loaded version `key` (after waiting for its in-flight load, if any), or None if neither."""
        with self._lock:
            if (found := self._hit(key)) is not None:
                return found
            pending = self._loading.get(key)
        return None if pending is None else self._wait(pending)

    def _wait(self, pending: _Pending) -> LoadedVersion:
        pending.done.wait()  # outside the cache's lock: other versions stay available meanwhile
        if pending.error is not None:
            raise pending.error
        assert pending.loaded is not None
        self.metrics.cache_hits.labels("version").inc()  # loaded once, for both askers
        return pending.loaded

    def _load(self, key: tuple[str, int], build: Callable[[], LoadedVersion]) -> tuple[LoadedVersion, bool]:
        """(version `key`, whether this thread loaded it): loaded by `build` outside the cache's lock unless it
        was loaded, or started loading, meanwhile (then that load's result). Registered as in flight only here,
        after the caller took whatever lock `build` needs, so no waiter waits on a load blocked on its lock."""
        with self._lock:
            if (found := self._hit(key)) is not None:
                return found, False
            pending = self._loading.get(key)
            if pending is None:
                pending = self._loading[key] = _Pending()
                self.metrics.cache_misses.labels("version").inc()
                mine = True
            else:
                mine = False
        if not mine:
            return self._wait(pending), False
        try:
            loaded = build()
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            pending.error = exc
            pending.done.set()
            raise
        with self._lock:
            self._keep(key, loaded)
            del self._loading[key]
        pending.loaded = loaded
        pending.done.set()
        return loaded, True

    def _keep(self, key: tuple[str, int], loaded: LoadedVersion) -> None:
        # under self._lock. An evicted model a task still uses stays alive through the task's own reference;
        # it is only no longer found here (a later get of it loads it again).
        self._loaded[key] = loaded
        self._loaded.move_to_end(key)
        while len(self._loaded) > self.keep_versions:
            self._loaded.popitem(last=False)

    def _replay_base(self, run: str, version: int) -> tuple[int, LoadedVersion]:
        """(version, it) where `_replay` to `version` starts, as it says; VersionUnavailable without a snapshot."""
        with self._lock:  # a snapshot load beside us may add or evict versions
            below = {v: lv for (r, v), lv in self._loaded.items() if r == run and v < version}
        base_v = max(below, default=None)
        base = below.get(base_v) if base_v is not None else None  # our reference: an eviction cannot take it
        if base_v is None or version - base_v > self.max_replay:
            snaps = [v for v in self.client.versions(run) if v < version]
            if not snaps:
                raise VersionUnavailable(f"run {run} has no snapshot below version {version} to replay from")
            if base_v is None or snaps[-1] > base_v:
                base_v = snaps[-1]
                base_manifest = self.client.version(run, base_v)
                base, _ = self._load((run, base_v), lambda: self._load_snapshot(run, base_v, base_manifest))
        assert base is not None and base_v is not None
        return base_v, base

    def _ledger_entries(self, run: str, base_v: int, version: int) -> list:
        """Seed-ledger entries base_v + 1 .. `version` (VersionUnavailable unless contiguous), 1000 per request."""
        entries: list = []
        while len(entries) < version - base_v:
            got = self.client.ledger(run, base_v + len(entries), min(1000, version - base_v - len(entries)))
            if not got:
                break
            entries += got
        if [e.version for e in entries] != list(range(base_v + 1, version + 1)):
            raise VersionUnavailable(f"run {run}: ledger from {base_v} does not reach version {version} contiguously")
        return entries

    @torch.no_grad()
    def _replay(self, run: str, version: int) -> LoadedVersion:
        """theta_version from the newest loaded (or, if none or too far behind, the newest snapshot) version
        below it, by applying seed-ledger entries: theta <- scale * theta + sum_k c_k z(s_k) per entry (scale
        only on parameters of at least `scale_min_dim` dimensions), in fp32 with the kernels' replay, exactly
        as `SeedLedgerEntry` defines the step and in the trainer's order (decay, then replay, per tensor).

        The caller excludes evaluations (`get`'s replay_lock): the base model's parameters are read here."""
        base_v, base = self._replay_base(run, version)
        if base.manifest.dtype != "float32":
            raise ValueError(f"ledger replay needs float32 master weights; version {base_v} is {base.manifest.dtype}")
        entries = self._ledger_entries(run, base_v, version)
        tensors = {n: p.detach().clone() for n, p in base.model.named_parameters()}
        model = build_from_tensors(base.manifest, tensors, self.device)
        ps = [p for _, p in model.named_parameters()]  # each with its canonical offset
        params = list(zip(ps, itertools.accumulate((p.numel() for p in ps), initial=0)))
        done = 0
        try:
            for e in entries:
                if self.stopping():
                    raise LoadStopped(f"run {run}: replay to version {version} stopped, the worker is stopping")
                self.interrupt()  # between entries: here the model is exactly version base_v + done
                # a cut inside an entry (a chunk hook, probe_kernels.reference) puts the entry's tensors back first
                backup = [p.detach().clone() for p, _ in params] if self.interruptible else None
                try:
                    for p, off in params:
                        if e.scale != 1.0 and p.dim() >= e.scale_min_dim:
                            p.data.mul_(e.scale)
                        replay_(p.data, list(e.seeds), list(e.coeffs), off, e.distribution)
                except BaseException:
                    for (p, _), b in zip(params, backup or []):
                        p.data.copy_(b)
                    if backup is None:
                        done = 0  # half an entry applied and nothing to undo it with: keep nothing
                    raise
                done += 1
        except BaseException:
            if done:  # keep what was replayed: the next replay starts from base_v + done, not from base_v again
                reached = base_v + done
                kept = base.manifest.model_copy(update={"version": reached, "parent": reached - 1})
                with self._lock:
                    self._keep((run, reached), LoadedVersion(kept, model))
            raise
        finally:
            self.metrics.replayed.inc(done)
        manifest = base.manifest.model_copy(update={"version": version, "parent": version - 1})
        return LoadedVersion(manifest, model)

    def _load_snapshot(self, run: str, version: int, manifest: VersionManifest) -> LoadedVersion:
        """Fetch (only missing shards), verify and load a snapshot version; prune old shards from disk.

        Reads no loaded model, so it needs no evaluation lock. On CUDA the host-to-device copies run on the
        loading thread's current stream (the default one), so they queue between an evaluation's kernels.
        Raises LoadStopped once `stopping()`: each shard checks it before it is read, so a stop waits only for the
        shards being read (at most SHARD_READ_THREADS), not for the whole snapshot."""
        tensors: dict[str, torch.Tensor] = {}
        key = (run, version)

        def read(ref: ShardRef) -> torch.Tensor:
            if self.stopping():
                raise LoadStopped(f"run {run} version {version}: load stopped before shard {ref.name}, the worker "
                                  "is stopping")
            return self.shard_buffer(ref)

        with self._lock:  # its shards are not pruned by another version's load meanwhile
            self._reading[key] = manifest
        try:
            # read and hash the shards in parallel (hashlib and file reads drop the GIL)
            pool = ThreadPoolExecutor(max(1, min(SHARD_READ_THREADS, len(manifest.shards))),
                                      thread_name_prefix="shard-read")
            try:
                bufs = list(pool.map(read, manifest.shards))
            finally:  # after an error (a stop, a corrupt shard) the shards not started are not read at all
                pool.shutdown(wait=True, cancel_futures=True)
        finally:
            with self._lock:
                del self._reading[key]
        for buf in bufs:
            part = parse_safetensors(buf)  # views of the verified buffer: no second copy
            if set(part) & set(tensors):
                raise ValueError(f"version {version}: tensor names repeat across shards")
            tensors.update(part)
        loaded = LoadedVersion(manifest, build_from_tensors(manifest, tensors, self.device))
        with self._lock:
            self._recent[key] = manifest
            self._recent.move_to_end(key)
            while len(self._recent) > self.keep_disk_versions:
                self._recent.popitem(last=False)
            self._prune()
        return loaded

    def _prune(self) -> None:
        """Delete shard files not referenced by the recent manifests (old versions, stray parts); under self._lock.

        The shards of snapshots still being read are kept, and so are partial files while one is read (they may
        be its downloads being written)."""
        keep = {ref.sha256 for m in [*self._recent.values(), *self._reading.values()] for ref in m.shards}
        for p in self.shard_dir.glob("??/*"):
            if p.name not in keep and not (self._reading and p.name.startswith(".part-")):
                p.unlink(missing_ok=True)
