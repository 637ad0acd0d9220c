"""`CoordinatorBackend`: the `ProbeBackend` (trainer/zo/backend.py) over the coordinator and its fleet.

- `publish(version)` writes the model's canonical parameters as safetensors shards (content-addressed by
  sha256), uploads the shards the blob store lacks and registers a `VersionManifest`. With `background=True`
  (what `train --coordinator` and `up` use) the call only copies the weights into reused (pinned) host buffers
  and the serialisation, uploads and registrations run in order on one thread (`HostCopies`, `flush`).
- `submit(round)` uploads the round's batch once (by content hash) and posts a wire `ProbeRound`; the
  coordinator turns it into Celery tasks for the probe workers.
- `collect(round_id)` reads accepted results from the run's Redis Stream through a consumer group
  (coordinator.stream.ResultStreamReader), honours retractions and drops, and acknowledges entries only
  when it hands them out, so a trainer restart loses nothing. Stale and duplicate results never reach
  the stream: the coordinator's intake decides them, and its counts (IntakeCounts) are returned with the results.

Every HTTP call goes through coordinator.client.CoordinatorClient (timeouts, bounded tenacity retries).
Wire formats shared with probe_worker: a round's batch is a versioned safetensors blob (fleet.batch_wire:
`lm/1` for causal LMs, `classifier/1` for sequence classifiers; the kind follows from the model class).
All probe kinds travel (trainer.zo.probes); the `scale` of along_update results is computed here
(probes.update_rms) from fp32 snapshots of the published versions (the wire ProbeResult has no scale).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Any

import torch

from coordinator.blobs import BlobStore
from coordinator.client import CoordinatorClient
from coordinator.messages import RunSpec, SeedLedgerEntry, ShardRef, VersionManifest
from fleet import batch_wire
from fleet.batch_wire import BatchKind
from fleet.shards import ShardPlan, plan_shards
from trainer.zo import probes
from trainer.zo.backend import COUNT_KEYS, Collected
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult

log = logging.getLogger("sparecycles.fleet")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_shards(model: torch.nn.Module, shard_bytes: int = 256 << 20,
                 weights: list[torch.Tensor] | None = None) -> list[tuple[str, bytes]]:
    """Split the canonical parameters into safetensors shards of about `shard_bytes` bytes each.

    `weights`: tensors to write instead of the live parameters, one per canonical block in order (a copy
    taken earlier: the trainer publishes it while it trains on). Returns [(name, bytes)] with names
    "shard-00000.safetensors", ... in canonical order; a parameter is never split. Serialisation is
    deterministic, so equal weights give equal bytes (and sha256). Raises ValueError for `weights` that do not
    match the blocks' count, shapes or dtypes. (Publishing streams the same bytes without this copy:
    `plan_model_shards`.)
    """
    return [(name, plan.to_bytes()) for name, plan in plan_model_shards(model, shard_bytes, weights)]


def plan_model_shards(model: torch.nn.Module, shard_bytes: int = 256 << 20,
                      weights: list[torch.Tensor] | None = None) -> list[tuple[str, ShardPlan]]:
    """`write_shards` as zero-copy `fleet.shards.ShardPlan`s over the (CPU) tensors: the same bytes, streamed."""
    blocks = probes.canonical_blocks(model)
    _check_weights(blocks, weights)
    return plan_shards([(b.name, (b.param if weights is None else weights[i]).detach().cpu().contiguous())
                        for i, b in enumerate(blocks)], shard_bytes)


def _check_weights(blocks, weights: list[torch.Tensor] | None) -> None:
    if weights is not None and (len(weights) != len(blocks) or any(
            w.shape != b.param.shape or w.dtype != b.param.dtype for w, b in zip(weights, blocks))):
        raise ValueError("weights must hold one tensor per canonical block, of its shape and dtype")


class HostCopies:
    """Reusable host buffers for the canonical parameters of one model: `take(blocks)` copies the current
    weights into a free set (pinned, asynchronous copies for CUDA weights; a CUDA event marks them done) and
    returns (slot, tensors, event); `give(slot)` frees the set. At most `slots` sets exist (bytes: slots x the
    model's parameter bytes); `take` raises RuntimeError when none is free (the caller waits for one first)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self._sets: list[list[torch.Tensor]] = []
        self._free: list[int] = []

    def free(self) -> int:
        """Sets free now or still to be allocated."""
        return len(self._free) + self.slots - len(self._sets)

    def take(self, blocks) -> tuple[int, list[torch.Tensor], torch.cuda.Event | None]:
        params = [b.param.detach() for b in blocks]
        cuda = params[0].is_cuda if params else False
        if self._free:
            slot = self._free.pop()
        elif len(self._sets) < self.slots:
            self._sets.append([torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda) for p in params])
            slot = len(self._sets) - 1
        else:
            raise RuntimeError("no free host buffer set; wait for a pending publish first")
        dst = self._sets[slot]
        for d, p in zip(dst, params):
            d.copy_(p, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return slot, dst, event

    def give(self, slot: int) -> None:
        self._free.append(slot)


def manifest_config(model: torch.nn.Module) -> dict[str, Any]:
    """The JSON model config a manifest carries: the HF config dict plus its attention implementation."""
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    cfg["attn_implementation"] = model.config._attn_implementation or "sdpa"
    return cfg


class CoordinatorBackend:
    """ProbeBackend whose rounds are evaluated by the coordinator's probe workers.

    Args:
        model: the trained module (its current weights are what `publish` sends).
        coordinator_url: e.g. "http://127.0.0.1:8000". admin_token: the coordinator's admin token.
        redis_url: Redis holding the coordinator's state (the results stream).
        run: a RunSpec (created if absent) or the id of an existing run.
        key_prefix: the coordinator's key prefix (settings.key_prefix).
        consumer: this trainer's consumer name in the stream's group "trainer".
        round_timeout_s: default wait of `collect(round_id)` for a round to complete, seconds.
        claim_idle_ms: entries idle this long in another consumer are claimed (a crashed trainer's).
        shard_bytes: target shard size in bytes. timeout_s / attempts: per request timeout, tries.
        history: published versions kept as fp32 snapshots here (>= 2 for along_update rounds, whose
            result `scale` is computed from them).
        background: publish, ledger and round uploads run in order on one background thread, so the training
            loop pays only for copying the weights to (reused, pinned) host buffers; at most `max_pending`
            publishes are in flight (a further one waits for the oldest). An upload's error is raised by the
            next call (publish, publish_ledger, submit, collect, flush, close). Off: every call returns after
            its uploads (the previous behaviour).
        blob_dir: the coordinator's blob directory when this process shares its file system (`up`, compose's
            `blobs` volume): shards are then written there (hashed while written, no fsync: versions are
            re-creatable) instead of sent over HTTP. At construction a random probe blob written there must be
            seen by `HEAD /v1/blobs/{sha}`; if it is not, or the directory cannot be written, the backend says
            so in `blob_dir_note` (and the log) and uploads over HTTP.
        upload_threads: shards hashed and written or uploaded at once (each shard streams without a copy).
    Rounds' batches are encoded as the model class's batch kind (fleet.batch_wire.batch_kind_for_model).
    Raises ValueError for a model whose parameters mix dtypes, a model class without a probe loss, or a
    negative history; CoordinatorHTTPError if the run does not exist.
    """

    evaluates_published = True  # workers probe published versions: a resume re-publishes and re-issues

    def __init__(self, model: torch.nn.Module, *, coordinator_url: str, admin_token: str, redis_url: str,
                 run: RunSpec | str, key_prefix: str = "sc", consumer: str = "trainer-0",
                 round_timeout_s: float = 300.0, claim_idle_ms: int = 60_000, shard_bytes: int = 256 << 20,
                 timeout_s: float = 30.0, attempts: int = 5, history: int = 2, background: bool = False,
                 max_pending: int = 2, blob_dir: str | Path | None = None, upload_threads: int = 8) -> None:
        from coordinator.stream import ResultStreamReader

        if history < 0:
            raise ValueError("history must be >= 0")
        if max_pending < 1 or upload_threads < 1:
            raise ValueError("max_pending and upload_threads must be >= 1")
        dtypes = {p.dtype for p in model.parameters()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
            raise ValueError(f"publishable models have one float dtype of {list(_DTYPE_NAMES.values())}")
        self.model, self.dtype = model, _DTYPE_NAMES[next(iter(dtypes))]
        self.blocks = probes.canonical_blocks(model)
        from trainer.models.params import param_order_hash

        # The manifest fields a model keeps for the whole run: computed once, not on every publish.
        self._model_fields = {"param_order_hash": param_order_hash(model), "dtype": self.dtype,
                              "model_class": type(model).__name__, "model_config_json": manifest_config(model)}
        self.batch_kind: BatchKind = batch_wire.batch_kind_for_model(type(model).__name__)
        self.round_timeout_s, self.shard_bytes, self.history = round_timeout_s, shard_bytes, history
        self.client = CoordinatorClient(coordinator_url, admin_token, timeout_s=timeout_s, attempts=attempts)
        if isinstance(run, RunSpec):
            self.client.create_run(run)
            self.run = run.run
        else:
            self.run = run
        self.client.run_info(self.run)  # raises if the run does not exist
        seen = self.client.intake_counts(self.run)
        self._intake_seen = (seen.stale, seen.duplicate)  # the coordinator's counts already reported
        self.reader = ResultStreamReader(redis_url, self.run, consumer=consumer, key_prefix=key_prefix,
                                         claim_idle_ms=claim_idle_ms)
        self.published: list[int] = []
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.forward_passes = 0  # fleet forward passes behind the results handed out (2 per seed, +1 L0/round)
        self._uploaded: set[str] = set()
        self._waiting: dict[str, set[int]] = {}  # round -> seeds not yet handed out (nor dropped)
        self._buffer: dict[tuple[str, int], tuple[str, SeedResult]] = {}  # (round, seed) -> (entry id, result)
        self._delivered: set[tuple[str, int]] = set()
        self._scales: dict[str, dict[int, float]] = {}  # along_update round -> block -> step RMS
        self._clean_counted: set[str] = set()
        self._counts: Counter[str] = Counter()  # dropped / retracted since the last collect
        self._io = ThreadPoolExecutor(1, thread_name_prefix="publish") if background else None
        self._jobs: deque[Future] = deque()  # background uploads in submission order
        self._broken: BaseException | None = None  # the first background job's failure
        self._host = HostCopies(max_pending) if background else None
        self._shard_pool = ThreadPoolExecutor(upload_threads, thread_name_prefix="shard")
        self.blob_dir_note = ""  # why a configured blob_dir is not used (empty: used, or none configured)
        self.local_blobs = self._shared_store(Path(blob_dir)) if blob_dir else None
        self.publish_seconds: list[float] = []  # the training loop's wall time in each publish call
        # version -> serialise_s (shard plans; waits for the host copy), upload_s (hash + PUT, or hash + write
        # into the shared blob_dir, of every shard, in parallel), register_s (the manifest), bytes, local
        # (1.0 when written into blob_dir): where a publish's time goes
        self.publish_timings: dict[int, dict[str, float]] = {}

    def _upload(self, data: bytes) -> str:
        return self._put(hashlib.sha256(data).hexdigest(), data)

    def _put(self, sha: str, body, nbytes: int | None = None) -> str:
        """PUT `body` (bytes, or a chunk callable of `nbytes`) as `sha` unless this backend sent it already."""
        if sha not in self._uploaded:
            self.client.put_blob(sha, body, nbytes)
            self._uploaded.add(sha)
        return sha

    def _shared_store(self, root: Path) -> BlobStore | None:
        """The BlobStore at `root` if it is the coordinator's blob directory, else None (and `blob_dir_note` says
        why). The test: a blob of 32 random bytes written there must be seen by `HEAD /v1/blobs/{sha}`; content the
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
        self.blob_dir_note = f"{why}; shards go over HTTP"
        log.warning(self.blob_dir_note)
        self.local_blobs = None

    def _store_shard(self, plan: ShardPlan) -> str:
        """Write one shard into the shared blob_dir, or hash it and PUT it if the coordinator lacks it; returns its
        sha256. Nothing is copied: the stream reads the tensors. A failed local write (disk full, permissions)
        stops using blob_dir and sends this shard and the later ones over HTTP."""
        local = self.local_blobs
        if local is not None:
            try:
                sha, _ = local.put_chunks(plan.chunks(), fsync=False)
            except OSError as exc:
                self._no_shared_store(f"writing a shard into blob_dir {local.root} failed ({exc})")
            else:
                self._uploaded.add(sha)
                return sha
        return self._put(plan.sha256(), plan.chunks, plan.nbytes)

    def _run(self, job: Callable[[], None]) -> None:
        """Run `job` now, or queue it on the background thread (after every job queued before it). Once a
        queued job failed, the jobs after it are not run (a round or ledger entry would name a version that was
        never registered): each raises RuntimeError from the first failure when `_check` reaches it."""
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

    def _check(self, wait_for: int | None = None) -> None:
        """Raise the first failed background job's error; wait until at most `wait_for` jobs are pending
        (None: do not wait)."""
        while self._jobs and (self._jobs[0].done() or (wait_for is not None and len(self._jobs) > wait_for)):
            self._jobs.popleft().result()

    def flush(self) -> None:
        """Wait for every background upload; raises the first one's error."""
        self._check(wait_for=0)

    def close(self, wait: bool = True) -> None:
        """Finish the background uploads (raising the first one's error), then close the HTTP client and the
        Redis connection. `wait=False` (a run that already failed or was interrupted) cancels the uploads not
        yet started instead of waiting for them."""
        try:
            if self._io is not None and wait:
                self.flush()
        finally:
            if self._io is not None:
                self._io.shutdown(wait=wait, cancel_futures=not wait)
            self._shard_pool.shutdown(wait=wait, cancel_futures=not wait)
            self.client.close()
            self.reader.r.close()

    # ---- ProbeBackend -------------------------------------------------------------------------------

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order (as InProcessBackend.block_sizes)."""
        return probes.block_sizes(self.blocks)

    @property
    def latest_version(self) -> int | None:
        """The newest version published (snapshot or ledger entry), None before the first."""
        return self.published[-1] if self.published else None

    def _snapshot(self, version: int, weights: list[torch.Tensor] | None = None) -> None:
        self.published.append(version)
        if self.history:
            src = [b.param for b in self.blocks] if weights is None else weights
            self.snapshots[version] = [w.detach().float().clone() for w in src]
            for v in sorted(self.snapshots)[: -self.history]:
                del self.snapshots[v]

    def publish(self, version: int, weights: list[torch.Tensor] | None = None) -> None:
        """Upload the model's current weights (or `weights`, a copy of them taken earlier, one tensor per
        canonical block: see write_shards) as `version` and register its manifest.

        Raises ValueError if `version` is not newer than the last published one or `weights` do not fit;
        CoordinatorHTTPError from the coordinator (e.g. 409 when the version exists with other content).
        """
        if self.published and version <= self.published[-1]:
            raise ValueError(f"version {version} is not newer than {self.published[-1]}")
        t0 = time.perf_counter()
        self._check()
        manifest = {"run": self.run, "version": version, "parent": self.latest_version, **self._model_fields}
        if self._host is None:
            self._write_version(version, lambda: plan_model_shards(self.model, self.shard_bytes, weights), manifest)
        else:
            if weights is not None:  # a copy the caller took: checked now, streamed on the upload thread
                _check_weights(self.blocks, weights)
                slot, tensors, event = None, [w.detach() for w in weights], None
            else:
                while not self._host.free():  # every host buffer set is in an upload: wait for the oldest
                    self._jobs.popleft().result()
                slot, tensors, event = self._host.take(self.blocks)
            names = [b.name for b in self.blocks]

            def shards() -> list[tuple[str, ShardPlan]]:
                if event is not None:
                    event.synchronize()
                return plan_shards([(n, t.cpu().contiguous()) for n, t in zip(names, tensors)], self.shard_bytes)

            def job() -> None:
                try:
                    self._write_version(version, shards, manifest)
                finally:  # the plans stream the host buffers themselves: free them only once sent
                    if slot is not None:
                        self._host.give(slot)

            self._run(job)
        self._snapshot(version, weights)
        self.publish_seconds.append(time.perf_counter() - t0)

    def _write_version(self, version: int, shards: Callable[[], list[tuple[str, ShardPlan]]], manifest: dict) -> None:
        """Plan (`shards()`), store (in parallel) and register one version; its timings go to `publish_timings`."""
        t0 = time.perf_counter()
        plans = shards()
        t1 = time.perf_counter()
        futures = [self._shard_pool.submit(self._store_shard, p) for _, p in plans]
        wait_all(futures)  # every stream has ended before a failure lets the caller reuse the host buffers
        shas = [f.result() for f in futures]
        refs = [ShardRef(name=name, sha256=sha, bytes=p.nbytes) for (name, p), sha in zip(plans, shas)]
        t2 = time.perf_counter()
        self.client.post_version(VersionManifest(shards=refs, **manifest))
        self.publish_timings[version] = {"serialise_s": t1 - t0, "upload_s": t2 - t1,
                                         "register_s": time.perf_counter() - t2,
                                         "bytes": float(sum(p.nbytes for _, p in plans)),
                                         "local": 1.0 if self.local_blobs is not None else 0.0}

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        """Publish `blocks` (the canonical blocks in fp32, as `snapshots` holds them) as `version` instead of the
        model's current weights: a resumed run re-publishes the versions its checkpointed rounds probe, since a
        new coordinator run holds none. Cast back to the model's dtype the bytes equal those `publish` sent.

        Raises ValueError if `version` is not newer than the last published one or the blocks do not fit.
        """
        if len(blocks) != len(self.blocks):
            raise ValueError(f"publish_weights needs {len(self.blocks)} tensors (one per canonical block)")
        self.publish(version, [t.to(b.param.dtype) for t, b in zip(blocks, self.blocks)])

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        """Register pure-ZO version `version` as a seed-ledger entry on the last published version:
        theta_version = scale * theta_parent + sum_k coeffs[k] z(seeds[k]) (bytes, not a snapshot), where
        `scale` multiplies only parameters with at least `scale_min_dim` dimensions (decoupled weight decay
        on matrices only: 2). Returns True.

        The caller must have applied exactly that update to the model (fp32, kernels.replay_), so that
        workers replaying the entry hold bit-identical weights. Raises ValueError unless version is the
        last published version + 1.
        """
        if not self.published or version != self.published[-1] + 1:
            raise ValueError(f"a ledger entry must follow the last published version "
                             f"({self.latest_version if self.published else 'none'}) by exactly one")
        self._check()
        entry = SeedLedgerEntry(
            run=self.run, version=version, parent=version - 1, seeds=[int(s) for s in seeds],
            coeffs=[float(c) for c in coeffs], distribution=dist, scale=float(scale),
            scale_min_dim=int(scale_min_dim))
        self._run(lambda: self.client.post_ledger(entry))
        self._snapshot(version)
        return True

    def submit(self, probe_round: RoundSpec) -> None:
        """Upload the batch (once per content) and open the round on the coordinator; returns at once.

        Like InProcessBackend, a round probes the model's current weights: a round whose version is newer
        than the last published one publishes the current weights as that version first.
        Raises ValueError for an along_update round without snapshots, a round at an older version that
        was never published, a group outside the blocks, or a round id the wire format refuses.
        """
        r = probe_round
        self._check()
        if not self.published or r.version > self.published[-1]:
            self.publish(r.version)
        elif r.version not in self.published:
            raise ValueError(f"version {r.version} was never published (last is {self.published[-1]})")
        if r.blocks:
            probes.check_group(r.blocks, len(self.blocks))
        if ProbeKind(r.kind) is ProbeKind.ALONG_UPDATE:
            missing = {r.version, r.base_version} - set(self.snapshots)
            if missing:
                raise ValueError(f"along_update round needs snapshots of versions {sorted(missing)}; construct "
                                 f"the backend with history >= 2 (have {sorted(self.snapshots)})")
            # computed now: the trainer keeps publishing while the fleet answers, pruning these snapshots
            new, base = self.snapshots[r.version], self.snapshots[r.base_version]
            self._scales[r.round_id] = {int(b): probes.update_rms(new[b] - base[b]) for b in r.seeds}
        data = batch_wire.encode_batch(r.batch, self.batch_kind)
        wire = r.to_wire(self.run, hashlib.sha256(data).hexdigest())

        def post() -> None:
            self._upload(data)
            self.client.post_round(wire)

        self._run(post)
        self._waiting[r.round_id] = set(wire.seeds)

    def _drain_stream(self, block_ms: int) -> None:
        """Buffer the stream's accepted results; apply retractions and drops (the coordinator's decisions)."""
        acks = []
        for entry_id, ev in self.reader.read(count=1000, block_ms=block_ms):
            key = (ev.round_id, ev.seed)
            if ev.kind == "accepted":
                if key in self._buffer and self._buffer[key][0] == entry_id:
                    continue  # our own pending entry re-read (claimed back after idling): still buffered
                if key in self._buffer or key in self._delivered:
                    acks.append(entry_id)  # an entry handed out before, re-read after a restart or claim
                    continue
                r = ev.result
                self._buffer[key] = (entry_id, SeedResult(r.round_id, r.seed, r.version, r.l_plus, r.l_minus, r.l0,
                                                          self._scales.get(r.round_id, {}).get(r.seed), r.worker_id))
                continue
            acks.append(entry_id)
            if ev.kind == "retracted":
                self._counts["retracted"] += 1
                if self._buffer.pop(key, None) is None and key in self._delivered:
                    self._delivered.discard(key)  # already used; a fresh value follows
                    self._waiting.setdefault(ev.round_id, set()).add(ev.seed)
            else:
                self._counts["dropped"] += 1
                self._waiting.get(ev.round_id, set()).discard(ev.seed)
        self.reader.ack(acks)

    def _hand_out(self, keys: list[tuple[str, int]]) -> list[SeedResult]:
        out, acks = [], []
        for key in keys:
            entry_id, res = self._buffer.pop(key)
            self._delivered.add(key)
            self.forward_passes += 2
            if res.l0 is not None and key[0] not in self._clean_counted:
                self._clean_counted.add(key[0])
                self.forward_passes += 1
            self._waiting.get(key[0], set()).discard(key[1])
            out.append(res)
            acks.append(entry_id)
        self.reader.ack(acks)
        return out

    def _intake_counts(self) -> dict[str, int]:
        """Growth of the coordinator's stale/duplicate counts of this run since they were last reported."""
        info = self.client.intake_counts(self.run)
        stale, dup = self._intake_seen
        self._intake_seen = (info.stale, info.duplicate)
        return {"stale": info.stale - stale, "duplicate": info.duplicate - dup}

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0) -> Collected:
        """Accepted results not handed out before (only `round_id`'s if given), each (round, seed) once,
        with the coordinator's counts since the last collect.

        With a `round_id` this backend submitted, waits up to `timeout_s` (0: round_timeout_s) until every
        seed of the round has arrived or was dropped; otherwise returns what is there now. The counts of
        `stale` and `duplicate` are the run's, from the coordinator's intake (IntakeCounts), since the last collect.
        """
        self._check()
        self._drain_stream(block_ms=0)  # what is there now: a training step pays this (trainer.zo.modes)
        if round_id is not None and round_id in self._waiting:
            wait = timeout_s or self.round_timeout_s
            deadline = time.monotonic() + wait
            while (self._waiting[round_id] - {s for (r, s) in self._buffer if r == round_id}
                   and time.monotonic() < deadline):
                self._check()  # a round whose upload failed never completes
                self._drain_stream(block_ms=200)
        keys = [k for k in self._buffer if round_id is None or k[0] == round_id]
        results = self._hand_out(keys)
        counts = dict.fromkeys(COUNT_KEYS, 0)
        counts.update(self._intake_counts())
        counts.update({k: v for k, v in self._counts.items()})
        counts["accepted"] = len(results)
        self._counts.clear()
        return Collected(results, counts)
