"""`CoordinatorBackend`: the `ProbeBackend` (trainer/zo/backend.py) over the coordinator and its fleet.

- `publish(version)` writes the model's canonical parameters as safetensors shards (content-addressed by
  sha256), uploads the shards the blob store lacks and registers a `VersionManifest`.
- `submit(round)` uploads the round's batch once (by content hash) and posts a `ProbeRound`; the
  coordinator turns it into Celery tasks for the probe workers.
- `poll(round_id)` reads accepted results from the run's Redis Stream through a consumer group
  (coordinator.stream.ResultStreamReader), deduplicates by (round, seed), honours retractions, and
  acknowledges entries only when it hands them out, so a trainer restart loses nothing.

Wire formats shared with probe_worker: a round's batch is a versioned safetensors blob (trainer.batch_wire:
`lm/1` = int64 "x", "y" (B, T) for causal LMs, `classifier/1` = "input_ids", "attention_mask" (B, T) and
"labels" (B,) for sequence classifiers); the kind, and with it the workers' loss, follows from the model
class. All three probe kinds travel; the `scale` of along_update results is computed here from fp32
snapshots of the published versions (the wire ProbeResult has no scale field).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import torch
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from coordinator.messages import ProbeRound as WireRound
from coordinator.messages import RunSpec, ShardRef, VersionManifest
from trainer import batch_wire
from trainer.batch_wire import BatchKind
from trainer.zo.backend import ProbeKind, ProbeResult, ProbeRound

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def encode_batch(batch: tuple[torch.Tensor, ...], kind: BatchKind = "lm") -> bytes:
    """`trainer.batch_wire.encode_batch` (kept here for callers of the LM codec): deterministic bytes."""
    return batch_wire.encode_batch(batch, kind)


def decode_batch(data: bytes, kind: BatchKind | None = None) -> tuple[torch.Tensor, ...]:
    """`trainer.batch_wire.decode_batch`: bytes -> the kind's int64 CPU tensors; BatchFormatError if malformed."""
    return batch_wire.decode_batch(data, kind)


def write_shards(model: torch.nn.Module, shard_bytes: int = 256 << 20) -> list[tuple[str, bytes]]:
    """Split the canonical parameters into safetensors shards of about `shard_bytes` bytes each.

    Returns [(name, bytes)] with names "shard-00000.safetensors", ... in canonical order; a parameter is
    never split. Serialisation is deterministic, so equal weights give equal bytes (and sha256).
    """
    from safetensors.torch import save

    from trainer.models.params import canonical_parameters

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in canonical_parameters(model):
        nbytes = p.numel() * p.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = p.detach().cpu().contiguous()
        size += nbytes
    return [(f"shard-{i:05d}.safetensors", save(s)) for i, s in enumerate(shards)]


def manifest_config(model: torch.nn.Module) -> dict[str, Any]:
    """The JSON model config a manifest carries: the HF config dict plus its attention implementation."""
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    cfg["attn_implementation"] = model.config._attn_implementation or "sdpa"
    return cfg


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and (exc.response.status_code in (429,) or
                                                       exc.response.status_code >= 500)


class CoordinatorBackend:
    """ProbeBackend whose rounds are evaluated by the coordinator's probe workers.

    Args:
        model: the trained module (its current weights are what `publish` sends).
        coordinator_url: e.g. "http://127.0.0.1:8000". admin_token: the coordinator's admin token.
        redis_url: Redis holding the coordinator's state (the results stream).
        run: a RunSpec (created if absent) or the id of an existing run.
        key_prefix: the coordinator's key prefix (settings.key_prefix).
        consumer: this trainer's consumer name in the stream's group "trainer".
        round_timeout_s: how long `poll(round_id)` waits for a round to complete, seconds.
        claim_idle_ms: entries idle this long in another consumer are claimed (a crashed trainer's).
        shard_bytes: target shard size in bytes. timeout_s / attempts: per request timeout, tries.
        history: published versions kept as fp32 snapshots here (>= 2 for along_update rounds, whose
            result `scale` = ||theta_v[b] - theta_base[b]|| / sqrt(n_b) is computed from them).
    Rounds' batches are encoded as the model class's batch kind (trainer.batch_wire.batch_kind_for_model).
    Raises ValueError for a model whose parameters mix dtypes, a model class without a probe loss, or a
    negative history.
    """

    def __init__(self, model: torch.nn.Module, *, coordinator_url: str, admin_token: str, redis_url: str,
                 run: RunSpec | str, key_prefix: str = "sc", consumer: str = "trainer-0",
                 round_timeout_s: float = 300.0, claim_idle_ms: int = 60_000, shard_bytes: int = 256 << 20,
                 timeout_s: float = 30.0, attempts: int = 5, history: int = 2) -> None:
        from coordinator.stream import ResultStreamReader

        if history < 0:
            raise ValueError("history must be >= 0")
        dtypes = {p.dtype for p in model.parameters()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
            raise ValueError(f"publishable models have one float dtype of {list(_DTYPE_NAMES.values())}")
        self.model, self.dtype = model, _DTYPE_NAMES[next(iter(dtypes))]
        self.batch_kind: BatchKind = batch_wire.batch_kind_for_model(type(model).__name__)
        self.round_timeout_s, self.shard_bytes, self.attempts = round_timeout_s, shard_bytes, attempts
        self.http = httpx.Client(base_url=coordinator_url.rstrip("/"), timeout=httpx.Timeout(timeout_s),
                                 headers={"Authorization": f"Bearer {admin_token}"})
        if isinstance(run, RunSpec):
            self._call("POST", "/v1/runs", json=run.model_dump(mode="json"), ok=(201, 409))
            self.run = run.run
        else:
            self.run = run
        self._call("GET", f"/v1/runs/{self.run}")  # raises if the run does not exist
        self.reader = ResultStreamReader(redis_url, self.run, consumer=consumer, key_prefix=key_prefix,
                                         claim_idle_ms=claim_idle_ms)
        self.published: list[int] = []
        self._uploaded: set[str] = set()
        self._rounds: dict[str, set[int]] = {}  # round -> seeds not yet handed out (nor dropped)
        self._buffer: dict[tuple[str, int], tuple[str, ProbeResult]] = {}  # (round, seed) -> (entry id, result)
        self._delivered: set[tuple[str, int]] = set()
        self._meta: dict[str, ProbeRound] = {}
        self._scales: dict[str, dict[int, float]] = {}  # along_update round -> block -> step RMS
        self.params = [p for _, p in model.named_parameters()]
        self.forward_passes = 0  # fleet forward passes behind the results handed out (2 per seed, +1 L0/round)
        self._clean_counted: set[str] = set()
        self.history = history
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.counts = {"accepted": 0, "duplicate": 0, "retracted": 0, "retracted_late": 0, "dropped": 0}

    # ---- HTTP ------------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, ok: tuple[int, ...] = (200, 201), **kw: Any) -> httpx.Response:
        def once() -> httpx.Response:
            r = self.http.request(method, path, **kw)
            if r.status_code not in ok:
                raise httpx.HTTPStatusError(f"{method} {path} -> {r.status_code}: {r.text[:300]}",
                                            request=r.request, response=r)
            return r

        for attempt in Retrying(stop=stop_after_attempt(self.attempts), reraise=True,
                                wait=wait_exponential(multiplier=0.2, max=5.0), retry=retry_if_exception(_transient)):
            with attempt:
                return once()
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _upload(self, data: bytes) -> str:
        import hashlib

        sha = hashlib.sha256(data).hexdigest()
        if sha not in self._uploaded:
            self._call("PUT", f"/v1/blobs/{sha}", content=data,
                       headers={"Content-Type": "application/octet-stream"})
            self._uploaded.add(sha)
        return sha

    def close(self) -> None:
        """Close the HTTP client and the Redis connection."""
        self.http.close()
        self.reader.r.close()

    # ---- ProbeBackend -------------------------------------------------------------------------------

    def publish(self, version: int) -> None:
        """Upload the model's current weights as `version` and register its manifest.

        Raises ValueError if `version` is not newer than the last published one; httpx errors from the
        coordinator (e.g. 409 when the version exists with other content).
        """
        from trainer.models.params import param_order_hash

        if self.published and version <= self.published[-1]:
            raise ValueError(f"version {version} is not newer than {self.published[-1]}")
        refs = [ShardRef(name=name, sha256=self._upload(data), bytes=len(data))
                for name, data in write_shards(self.model, self.shard_bytes)]
        manifest = VersionManifest(
            run=self.run, version=version, parent=self.published[-1] if self.published else None, shards=refs,
            param_order_hash=param_order_hash(self.model), dtype=self.dtype,
            model_class=type(self.model).__name__, model_config_json=manifest_config(self.model),
        )
        self._call("POST", f"/v1/runs/{self.run}/versions", json=manifest.model_dump(mode="json"))
        self.published.append(version)
        if self.history:
            self.snapshots[version] = [p.detach().float().clone() for p in self.model.parameters()]
            for v in sorted(self.snapshots)[: -self.history]:
                del self.snapshots[v]

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> None:
        """Register pure-ZO version `version` as a seed-ledger entry on the last published version:
        theta_version = scale * theta_parent + sum_k coeffs[k] z(seeds[k]) (bytes, not a snapshot), where
        `scale` multiplies only parameters with at least `scale_min_dim` dimensions (decoupled weight decay
        on matrices only: 2).

        The caller must have applied exactly that update to the model (fp32, kernels.replay_), so that
        workers replaying the entry hold bit-identical weights. Raises ValueError unless version is the
        last published version + 1.
        """
        from coordinator.messages import SeedLedgerEntry

        if not self.published or version != self.published[-1] + 1:
            raise ValueError(f"a ledger entry must follow the last published version "
                             f"({self.published[-1] if self.published else 'none'}) by exactly one")
        entry = SeedLedgerEntry(run=self.run, version=version, parent=version - 1, seeds=[int(s) for s in seeds],
                                coeffs=[float(c) for c in coeffs], distribution=dist, scale=float(scale),
                                scale_min_dim=int(scale_min_dim))
        self._call("POST", f"/v1/runs/{self.run}/ledger", json=entry.model_dump(mode="json"))
        self.published.append(version)
        if self.history:
            self.snapshots[version] = [p.detach().float().clone() for p in self.model.parameters()]
            for v in sorted(self.snapshots)[: -self.history]:
                del self.snapshots[v]

    def _scale(self, round_id: str, seed: int) -> float | None:
        """||u_b|| / sqrt(n_b) of an along_update result (block b = seed), as InProcessBackend computes it.

        Computed when the round is submitted (`_round_scales`): a fleet answers rounds while the trainer
        keeps publishing, and the two snapshots may be pruned before the results arrive.
        """
        return self._scales.get(round_id, {}).get(seed)

    def _round_scales(self, rnd: ProbeRound) -> dict[int, float]:
        new, base = self.snapshots[rnd.version], self.snapshots[rnd.base_version]
        out = {}
        for b in rnd.seeds:
            u = new[b] - base[b]
            out[int(b)] = float(torch.linalg.vector_norm(u.double())) / math.sqrt(u.numel())
        return out

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order (as InProcessBackend.block_sizes)."""
        return [p.numel() for p in self.params]

    def submit(self, probe_round: ProbeRound) -> None:
        """Upload the batch (once per content) and open the round on the coordinator; returns at once.

        Like InProcessBackend, a round probes the model's current weights: a round whose version is newer
        than the last published one publishes the current weights as that version first.
        Raises ValueError for an along_update round without snapshots, a round at an older version that
        was never published, or a round id the wire format refuses.
        """
        if not self.published or probe_round.version > self.published[-1]:
            self.publish(probe_round.version)
        elif probe_round.version not in self.published:
            raise ValueError(f"version {probe_round.version} was never published (last is {self.published[-1]})")
        if probe_round.kind is ProbeKind.ALONG_UPDATE:
            missing = {probe_round.version, probe_round.base_version} - set(self.snapshots)
            if missing:
                raise ValueError(f"along_update round needs snapshots of versions {sorted(missing)}; construct "
                                 f"the backend with history >= 2 (have {sorted(self.snapshots)})")
        wire = WireRound(
            run=self.run, round_id=probe_round.round_id, version=probe_round.version,
            batch_sha256=self._upload(encode_batch(probe_round.batch, self.batch_kind)), eps=float(probe_round.eps),
            distribution=str(probe_round.dist), seeds=[int(s) for s in probe_round.seeds],
            want_clean=probe_round.want_clean, kind=probe_round.kind.value, base_version=probe_round.base_version,
        )
        self._call("POST", f"/v1/runs/{self.run}/rounds", json=wire.model_dump(mode="json"))
        self._rounds[probe_round.round_id] = set(wire.seeds)
        self._meta[probe_round.round_id] = probe_round
        if probe_round.kind is ProbeKind.ALONG_UPDATE:
            self._scales[probe_round.round_id] = self._round_scales(probe_round)

    def _drain_stream(self, block_ms: int) -> None:
        acks = []
        for entry_id, ev in self.reader.read(count=1000, block_ms=block_ms):
            key = (ev.round_id, ev.seed)
            if ev.kind == "accepted":
                if key in self._buffer and self._buffer[key][0] == entry_id:
                    continue  # our own pending entry re-read (claimed back after idling): still buffered
                if key in self._delivered or key in self._buffer:
                    self.counts["duplicate"] += 1
                    acks.append(entry_id)
                    continue
                r = ev.result
                self._buffer[key] = (entry_id, ProbeResult(r.round_id, r.seed, r.version, r.l_plus, r.l_minus,
                                                           r.l0, self._scale(r.round_id, r.seed), r.worker_id))
                self.counts["accepted"] += 1
            else:
                acks.append(entry_id)
                if ev.kind == "retracted":
                    if self._buffer.pop(key, None) is not None:
                        self.counts["retracted"] += 1
                    elif key in self._delivered:
                        self.counts["retracted_late"] += 1  # already used; a fresh value follows
                        self._delivered.discard(key)
                        self._rounds.setdefault(ev.round_id, set()).add(ev.seed)
                else:
                    self.counts["dropped"] += 1
                    self._rounds.get(ev.round_id, set()).discard(ev.seed)
        self.reader.ack(acks)

    def _hand_out(self, keys: list[tuple[str, int]]) -> list[ProbeResult]:
        out, acks = [], []
        for key in keys:
            entry_id, res = self._buffer.pop(key)
            self._delivered.add(key)
            self.forward_passes += 2
            if res.l0 is not None and key[0] not in self._clean_counted:
                self._clean_counted.add(key[0])
                self.forward_passes += 1
            self._rounds.get(key[0], set()).discard(key[1])
            out.append(res)
            acks.append(entry_id)
        self.reader.ack(acks)
        return out

    def poll(self, round_id: str | None = None) -> list[ProbeResult]:
        """Accepted results not handed out before (only `round_id`'s if given), each (round, seed) once.

        With a `round_id` this backend submitted, waits up to `round_timeout_s` until every seed of the
        round has arrived (or was dropped by the coordinator); otherwise returns what is there now.
        """
        self._drain_stream(block_ms=1)
        if round_id is not None and round_id in self._rounds:
            deadline = time.monotonic() + self.round_timeout_s
            while (self._rounds[round_id] - {s for (r, s) in self._buffer if r == round_id}
                   and time.monotonic() < deadline):
                self._drain_stream(block_ms=200)
        keys = [k for k in self._buffer if round_id is None or k[0] == round_id]
        return self._hand_out(keys)
