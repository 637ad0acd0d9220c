"""`VersionPublisher`: a model's weight versions onto the coordinator (DESIGN.md §3, "Weights").

`publish(version)` writes the model's canonical parameters as safetensors shards (content-addressed by sha256),
stores the shards the blob store lacks (fleet.uploads.BlobSender: HTTP or the shared blob directory) and
registers a `VersionManifest`. With a background `UploadQueue` (what `train --coordinator` and `up` use) the
call only copies the weights into reused (pinned) host buffers (`HostCopies`); serialisation, uploads and
registration run in order on the queue's thread. `publish_ledger` registers a pure-ZO version as a seed-ledger
entry instead. The publisher keeps fp32 snapshots of the last `history` versions (along_update rounds compute
their result `scale` from them: fleet.round_sender).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any

import torch

from coordinator.client import CoordinatorClient
from fleet.uploads import BlobSender, UploadQueue
from trainer.models.params import param_order_hash
from trainer.zo import probes
from wire.messages import SeedLedgerEntry, ShardRef, VersionManifest
from wire.shards import ShardPlan, plan_shards

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    """`write_shards` as zero-copy `wire.shards.ShardPlan`s over the (CPU) tensors: the same bytes, streamed."""
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


class VersionPublisher:
    """Publishes versions of one model's weights to one coordinator run.

    Args:
        model: the trained module (its current weights are what `publish` sends); one float dtype of DTYPE_NAMES.
        run: the coordinator run's id. client: its HTTP client (manifests, ledger entries).
        blobs: where shards go (BlobSender). uploads: the queue the sends run on (UploadQueue; shared with the
            round sender, so a round is never posted before the version it probes).
        shard_bytes: target shard size in bytes. history: versions kept as fp32 `snapshots` (>= 2 for
            along_update rounds). max_pending: host buffer sets for background publishes (a further publish
            waits for the oldest). upload_threads: shards hashed and written or uploaded at once.
    Raises ValueError for a model whose parameters mix dtypes or use another one, negative history, or
    max_pending / upload_threads < 1.
    """

    def __init__(self, model: torch.nn.Module, run: str, client: CoordinatorClient, blobs: BlobSender,
                 uploads: UploadQueue, *, shard_bytes: int = 256 << 20, history: int = 2, max_pending: int = 2,
                 upload_threads: int = 8) -> None:
        if history < 0:
            raise ValueError("history must be >= 0")
        if max_pending < 1 or upload_threads < 1:
            raise ValueError("max_pending and upload_threads must be >= 1")
        dtypes = {p.dtype for p in model.parameters()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
            raise ValueError(f"publishable models have one float dtype of {list(DTYPE_NAMES.values())}")
        self.model, self.run, self.client, self.blobs, self.uploads = model, run, client, blobs, uploads
        self.blocks = probes.canonical_blocks(model)
        self.shard_bytes, self.history = shard_bytes, history
        # The manifest fields a model keeps for the whole run: computed once, not on every publish.
        self._model_fields = {"param_order_hash": param_order_hash(model), "dtype": DTYPE_NAMES[next(iter(dtypes))],
                              "model_class": type(model).__name__, "model_config_json": manifest_config(model)}
        self._host = HostCopies(max_pending) if uploads.background else None
        self._shard_pool = ThreadPoolExecutor(upload_threads, thread_name_prefix="shard")
        self.published: list[int] = []
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.publish_seconds: list[float] = []  # the training loop's wall time in each publish call
        # version -> serialise_s (shard plans; waits for the host copy), upload_s (hash + PUT, or hash + write
        # into the shared blob_dir, of every shard, in parallel), register_s (the manifest), bytes, local
        # (1.0 when written into blob_dir): where a publish's time goes
        self.publish_timings: dict[int, dict[str, float]] = {}

    @property
    def latest_version(self) -> int | None:
        """The newest version published (snapshot or ledger entry), None before the first."""
        return self.published[-1] if self.published else None

    def forget_published(self) -> tuple[dict[int, list[torch.Tensor]], int | None]:
        """The coordinator lost the run (fleet.recovery): forget every version published; returns what was held
        (the fp32 snapshots, the latest version) so it can be published again."""
        held, latest = dict(self.snapshots), self.latest_version
        self.published.clear()
        self.snapshots.clear()
        return held, latest

    def close(self, wait: bool = True) -> None:
        """Stop the shard pool (`wait=False`: cancel shards not yet started). Call after the upload queue closed."""
        self._shard_pool.shutdown(wait=wait, cancel_futures=not wait)

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
        self.uploads.check()
        manifest = {"run": self.run, "version": version, "parent": self.latest_version, **self._model_fields}
        if self._host is None:
            self._write_version(version, lambda: plan_model_shards(self.model, self.shard_bytes, weights), manifest)
        else:
            if weights is not None:  # a copy the caller took: checked now, streamed on the upload thread
                _check_weights(self.blocks, weights)
                slot, tensors, event = None, [w.detach() for w in weights], None
            else:
                while not self._host.free():  # every host buffer set is in an upload: wait for the oldest
                    self.uploads.wait_oldest()
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

            self.uploads.run(job)
        self._snapshot(version, weights)
        self.publish_seconds.append(time.perf_counter() - t0)

    def _write_version(self, version: int, shards: Callable[[], list[tuple[str, ShardPlan]]], manifest: dict) -> None:
        """Plan (`shards()`), store (in parallel) and register one version; its timings go to `publish_timings`."""
        t0 = time.perf_counter()
        plans = shards()
        t1 = time.perf_counter()
        futures = [self._shard_pool.submit(self.blobs.store_shard, p) for _, p in plans]
        wait_all(futures)  # every stream has ended before a failure lets the caller reuse the host buffers
        shas = [f.result() for f in futures]
        refs = [ShardRef(name=name, sha256=sha, bytes=p.nbytes) for (name, p), sha in zip(plans, shas)]
        t2 = time.perf_counter()
        self.client.post_version(VersionManifest(shards=refs, **manifest))
        self.publish_timings[version] = {"serialise_s": t1 - t0, "upload_s": t2 - t1,
                                         "register_s": time.perf_counter() - t2,
                                         "bytes": float(sum(p.nbytes for _, p in plans)),
                                         "local": 1.0 if self.blobs.local is not None else 0.0}

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

        The caller must have applied exactly that update to the model (fp32, probe_kernels.replay_), so that
        workers replaying the entry hold bit-identical weights. Raises ValueError unless version is the
        last published version + 1.
        """
        if not self.published or version != self.published[-1] + 1:
            raise ValueError(f"a ledger entry must follow the last published version "
                             f"({self.latest_version if self.published else 'none'}) by exactly one")
        self.uploads.check()
        entry = SeedLedgerEntry(
            run=self.run, version=version, parent=version - 1, seeds=[int(s) for s in seeds],
            coeffs=[float(c) for c in coeffs], distribution=dist, scale=float(scale),
            scale_min_dim=int(scale_min_dim))
        self.uploads.run(lambda: self.client.post_ledger(entry))
        self._snapshot(version)
        return True
