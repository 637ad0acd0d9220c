"""Wire messages between coordinator, workers and trainer (DESIGN.md section 3).

Every message is a strict, frozen, versioned pydantic model: unknown fields, wrong types (no str->int
coercion), non-finite floats and oversize lists are rejected with a `pydantic.ValidationError`. Ids are
restricted by regex so they are safe as Redis key parts, Celery queue names and file names.
Seeds are unsigned 64-bit integers (0 <= s < 2**64), the Philox key of DESIGN.md section 1. Each setting's
one bound (probe step, staleness, seeds) is defined in wire.bounds. This module holds the base, worker
and run messages; a probe round's family (round, task, result, stream event) is wire.round_messages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from wire.bounds import Seed, Share, Staleness

SCHEMA_VERSION = 1
MAX_SEEDS_PER_ROUND = 65_536
MAX_SEEDS_PER_TASK = 256
MAX_RESULTS_PER_BATCH = 1024
MAX_SHARDS = 4096

RunId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
RoundId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")]
WorkerId = Annotated[str, Field(pattern=r"^w-[0-9a-f]{16}$")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
ShortText = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$")]
Version = Annotated[int, Field(ge=0, lt=2**53)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Distribution = Literal["rademacher", "gauss8"]
DType = Literal["float32", "bfloat16", "float16"]
WorkerState = Literal["active", "draining", "lost", "quarantined"]
# seeded: z(seed); block_scaled: per-block gauss8 scale times Rademacher signs; along_update: the update
# theta_version - theta_base restricted to block `seed`; group: z(seed) restricted to the round's `blocks`;
# line: seed * eps times the whole update theta_version - theta_base; group_line: one point along the update
# restricted to the round's `blocks` (and `slices`), the seed a zigzag-coded signed step multiple k
# (wire.round_messages.line_multiple), alpha = k * eps; eval: no perturbation, the "seed" is the index of a
# held-out evaluation batch (schema 3, `eval`: EvalSpec) (the meaning of each: trainer.zo.probes.KINDS, which a test
# keeps equal to this list).
ProbeKindName = Literal["seeded", "block_scaled", "along_update", "group", "line", "group_line", "eval"]
BASE_KINDS = ("along_update", "line", "group_line")  # kinds probing along theta_version - theta_base
GROUP_KINDS = ("group", "group_line")  # kinds moving only the round's `blocks` (schema 2), some of them in `slices`
MAX_BLOCKS = 1 << 20  # canonical blocks of a model (parameter tensors): far above any real model
BlockIndex = Annotated[int, Field(ge=0, lt=MAX_BLOCKS)]
# A group (or group_line) round's block slice [block, dim, start, stop]: only elements with index in [start, stop)
# along `dim` of that block move (GPT-2's fused c_attn holds two roles' columns; trainer.zo.probes.group_weights).
BlockSlice = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=4, max_length=4)]


class Message(BaseModel):
    """Base of every wire message: strict, frozen, unknown fields forbidden, `schema_version == 1`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
    schema_version: Literal[1] = 1


class Part(BaseModel):
    """Base of nested parts of messages (no version of their own): same strictness as `Message`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# ---- workers -----------------------------------------------------------------------------------------


class WorkerRegistration(Message):
    """`POST /v1/workers` body: a worker asks to join (authorised by the enrollment token)."""

    name: ShortText
    device: ShortText = "cpu"
    host: ShortText = "unknown"


class WorkerRegistered(Message):
    """`POST /v1/workers` reply: identity, secret and everything needed to start the Celery worker.

    `worker_token` is shown once; the coordinator keeps only its sha256. `queues` are the Celery queues
    of the currently active runs, `teacher_queues` those of the teacher runs registered at the coordinator
    (`POST /v1/teachers`; heartbeat replies carry the up-to-date lists). Times are seconds.
    """

    worker_id: WorkerId
    worker_token: str
    broker_url: str
    queues: list[str] = Field(max_length=1024)
    teacher_queues: list[str] = Field(default_factory=list, max_length=1024)
    heartbeat_interval_s: FiniteFloat = Field(gt=0)
    lease_seconds: FiniteFloat = Field(gt=0)
    visibility_timeout_s: int = Field(gt=0)
    probe_task_name: str


class ServingFigures(Part):
    """A worker's figures beside a serving engine (probe_worker.serving.ServingLedger), cumulative since it started.

    Seconds: yielded (not taking tasks for the engine), the engine's idle time, the part of it the worker spent in
    tasks; reclaim latency (a request's arrival -> the worker's task ending, an upper bound) as its recent p95 (None
    before any) and count; unreadable metrics scrapes.
    """

    yielded_s: FiniteFloat = Field(ge=0)
    engine_idle_s: FiniteFloat = Field(ge=0)
    idle_used_s: FiniteFloat = Field(ge=0)
    reclaim_p95_s: FiniteFloat | None = Field(default=None, ge=0)
    reclaims: int = Field(default=0, ge=0)
    scrape_errors: int = Field(default=0, ge=0)


class Heartbeat(Message):
    """`POST /v1/workers/{id}/heartbeat` body: liveness plus what the worker is doing (`serving`: only for a worker
    beside a serving engine)."""

    busy: bool = False
    version: Version | None = None
    tasks_done: int = Field(default=0, ge=0)
    serving: ServingFigures | None = None


class Lease(Part):
    """A worker's lease: valid until `expires_at` (unix seconds); renewed by each heartbeat."""

    worker_id: WorkerId
    expires_at: FiniteFloat
    lease_seconds: FiniteFloat = Field(gt=0)


class HeartbeatReply(Message):
    """Heartbeat reply: the renewed lease, the worker's state (drain requests arrive here), the probe queues and
    the teacher queues (WorkerRegistered's)."""

    lease: Lease
    state: WorkerState
    queues: list[str] = Field(max_length=1024)
    teacher_queues: list[str] = Field(default_factory=list, max_length=1024)


class WorkerInfo(Message):
    """`GET /v1/workers` entry. Times are unix seconds; counters count results since registration."""

    worker_id: WorkerId
    name: str
    device: str
    host: str
    state: WorkerState
    registered_at: FiniteFloat
    last_heartbeat: FiniteFloat
    lease_expires_at: FiniteFloat
    busy: bool
    version: Version | None
    accepted: int
    rejected: int
    serving: ServingFigures | None = None


# ---- runs, versions, ledger, blobs --------------------------------------------------------------------


class CanarySpec(Part):
    """Canary for the z-generator: sha256 of z(seed)[0:numel] as little-endian float32 bytes.

    A worker must post the same digest (`POST /v1/runs/{run}/attest`) before its results count.
    """

    seed: Seed
    numel: int = Field(ge=1, le=1 << 24)
    distribution: Distribution
    digest: Sha256Hex


class RunSpec(Message):
    """`POST /v1/runs` body. `staleness` S: results for versions older than latest - S are dropped.

    Spot checks: a fraction `spot_check_fraction` of each round's seeds is evaluated by two workers;
    values disagreeing by more than `spot_atol + spot_rtol * max(|a|, |b|)` trigger a third evaluation.

    `share` (schema version 2; wire.bounds.Share: finite, > 0, <= MAX_SHARE) is the run's weight in the pool: the
    coordinator splits workers' time between runs with work in proportion to their shares (coordinator.share_math).
    A spec whose share is the default 1 serialises without it, byte-identical to a schema-1 spec.
    """

    schema_version: Literal[1, 2] = 1
    run: RunId
    model_class: ShortText
    model_preset: ShortText | None = None
    model_config_json: dict[str, JsonValue] = Field(default_factory=dict)
    dtype: DType = "float32"
    distribution: Distribution = "rademacher"
    staleness: Staleness = 2
    spot_check_fraction: FiniteFloat = Field(default=0.05, ge=0.0, le=1.0)
    spot_rtol: FiniteFloat = Field(default=1e-5, ge=0.0, le=1.0)
    spot_atol: FiniteFloat = Field(default=1e-6, ge=0.0, le=1e3)
    seeds_per_task: int = Field(default=4, ge=1, le=MAX_SEEDS_PER_TASK)
    canary: CanarySpec | None = None
    share: Share = 1.0

    @model_serializer(mode="wrap")
    def _drop_default_share(self, handler: SerializerFunctionWrapHandler) -> dict:
        """Without `share` when it is the default 1 (what schema-1 coordinators accept: they forbid unknown fields)."""
        out = handler(self)
        if out.get("share") == 1.0:
            del out["share"]
        return out

    @model_validator(mode="after")
    def _check_share_schema(self) -> RunSpec:
        if self.share != 1.0 and self.schema_version < 2:
            raise ValueError("a share other than 1 needs schema_version 2")
        return self


def share_fields(share: float) -> dict[str, float | int]:
    """A RunSpec's keyword arguments for a run of `share` ({} for the default 1, which schema 1 carries)."""
    return {} if share == 1.0 else {"share": share, "schema_version": 2}


class RunInfo(Message):
    """`GET /v1/runs/{run}` reply. `latest_version` is -1 before the first version or ledger entry."""

    spec: RunSpec
    queue: str
    latest_version: int
    open_rounds: list[str] = Field(max_length=100_000)
    created_at: FiniteFloat


class IntakeCounts(Message):
    """`GET /v1/runs/{run}/intake` reply: results intake refused as `stale` or `duplicate` in the run so far.

    Monotone counters; the trainer reports their growth with the results it collects (intake is the one
    authority on which results count). A message of its own so that RunInfo stays what older clients parse.
    """

    run: RunId
    stale: int = Field(ge=0)
    duplicate: int = Field(ge=0)


class ShardRef(Part):
    """One safetensors shard of a version, content-addressed by sha256; `bytes` is its size."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
    sha256: Sha256Hex
    bytes: int = Field(ge=0, lt=2**50)


class VersionManifest(Message):
    """A full weight snapshot: shards already in the blob store, in canonical parameter order."""

    run: RunId
    version: Version
    parent: Version | None = None
    shards: list[ShardRef] = Field(min_length=1, max_length=MAX_SHARDS)
    param_order_hash: Sha256Hex
    dtype: DType
    model_class: ShortText
    model_config_json: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> VersionManifest:
        if self.parent is not None and self.parent >= self.version:
            raise ValueError("parent must be older than version")
        if len({s.name for s in self.shards}) != len(self.shards):
            raise ValueError("shard names must be unique")
        return self


class SeedLedgerEntry(Message):
    """Pure-ZO update: theta_version = scale * theta_parent + sum_k coeffs[k] * z(seeds[k]).

    `version == parent + 1`; `scale` carries decoupled weight decay (1 - lr * wd) and multiplies only the
    parameters with at least `scale_min_dim` dimensions (0: all; 2: matrices only, the GPT-2 recipe that
    trainer.zo.zo_step.ZOStepper follows), each before its seeds are replayed onto it.
    """

    run: RunId
    version: Version
    parent: Version
    seeds: list[Seed] = Field(min_length=1, max_length=MAX_SEEDS_PER_ROUND)
    coeffs: list[FiniteFloat] = Field(min_length=1, max_length=MAX_SEEDS_PER_ROUND)
    distribution: Distribution
    scale: FiniteFloat = 1.0
    scale_min_dim: int = Field(default=0, ge=0, le=8)

    @model_validator(mode="after")
    def _check(self) -> SeedLedgerEntry:
        if len(self.seeds) != len(self.coeffs):
            raise ValueError("seeds and coeffs must have the same length")
        if self.version != self.parent + 1:
            raise ValueError("a ledger entry must advance exactly one version (version == parent + 1)")
        return self


class BlobInfo(Message):
    """Reply of a blob upload: the content hash and size in bytes."""

    sha256: Sha256Hex
    bytes: int


class Attestation(Message):
    """`POST /v1/runs/{run}/attest` body: the worker's digest of the run's canary direction."""

    worker_id: WorkerId
    digest: Sha256Hex
