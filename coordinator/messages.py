"""Wire messages between coordinator, workers and trainer (DESIGN.md section 3).

Every message is a strict, frozen, versioned pydantic model: unknown fields, wrong types (no str->int
coercion), non-finite floats and oversize lists are rejected with a `pydantic.ValidationError`. Ids are
restricted by regex so they are safe as Redis key parts, Celery queue names and file names.
Seeds are unsigned 64-bit integers (0 <= s < 2**64), the Philox key of DESIGN.md section 1. Each setting's
one bound (probe step, staleness, seeds) is defined in coordinator.bounds.
"""

from __future__ import annotations

import itertools
import math
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

from coordinator.bounds import ProbeEps, Seed, Staleness

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
# line: seed * eps times the whole update theta_version - theta_base (the meaning of each:
# trainer.zo.probes.KINDS, which a test keeps equal to this list).
ProbeKindName = Literal["seeded", "block_scaled", "along_update", "group", "line"]
BASE_KINDS = ("along_update", "line")  # kinds probing along theta_version - theta_base
MAX_BLOCKS = 1 << 20  # canonical blocks of a model (parameter tensors): far above any real model
BlockIndex = Annotated[int, Field(ge=0, lt=MAX_BLOCKS)]
# A group round's block slice [block, dim, start, stop]: only elements with index in [start, stop) along `dim` of
# that block move (GPT-2's fused c_attn holds two roles' columns; trainer.zo.probes.group_weights).
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
    of the currently active runs (heartbeat replies carry the up-to-date list).
    Times are seconds.
    """

    worker_id: WorkerId
    worker_token: str
    broker_url: str
    queues: list[str] = Field(max_length=1024)
    heartbeat_interval_s: FiniteFloat = Field(gt=0)
    lease_seconds: FiniteFloat = Field(gt=0)
    visibility_timeout_s: int = Field(gt=0)
    probe_task_name: str


class Heartbeat(Message):
    """`POST /v1/workers/{id}/heartbeat` body: liveness plus what the worker is doing."""

    busy: bool = False
    version: Version | None = None
    tasks_done: int = Field(default=0, ge=0)


class Lease(Part):
    """A worker's lease: valid until `expires_at` (unix seconds); renewed by each heartbeat."""

    worker_id: WorkerId
    expires_at: FiniteFloat
    lease_seconds: FiniteFloat = Field(gt=0)


class HeartbeatReply(Message):
    """Heartbeat reply: the renewed lease, the worker's state (drain requests arrive here) and queues."""

    lease: Lease
    state: WorkerState
    queues: list[str] = Field(max_length=1024)


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
    """

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


MAX_LINE_SEED = 64  # a `line` seed j is the step multiple α = ±j·eps along θ_version − θ_base
MAX_LINE_STEP = 16.0  # j·eps: further than 16 updates along the line is no curvature probe, and overflows


def check_line_seeds(kind: str, seeds: list[int], eps: float) -> None:
    """A `line` round's seeds are step multiples 1 <= j <= MAX_LINE_SEED with j·eps <= MAX_LINE_STEP (a worker
    would refuse a seed 0 only after dispatch, and a huge j·eps gives non-finite losses)."""
    if kind != "line":
        return
    if min(seeds) < 1 or max(seeds) > MAX_LINE_SEED:
        raise ValueError(f"line seeds are step multiples 1..{MAX_LINE_SEED}, got {min(seeds)}..{max(seeds)}")
    if max(seeds) * eps > MAX_LINE_STEP:
        raise ValueError(f"line probes reach j*eps = {max(seeds) * eps:g} > {MAX_LINE_STEP:g} updates along the line")


def _check_kind(kind: str, version: int, base_version: int | None, blocks: list[int] | None,
                schema_version: int) -> None:
    if kind in BASE_KINDS:
        if base_version is None or base_version >= version:
            raise ValueError(f"{kind} rounds need base_version < version")
    elif base_version is not None:
        raise ValueError("base_version is only meaningful for along_update and line rounds")
    if kind == "group":
        if schema_version < 2 or not blocks:
            raise ValueError("a group round needs schema_version 2 and a non-empty `blocks` list")
        if any(a >= b for a, b in itertools.pairwise(blocks)):
            raise ValueError("group blocks must be sorted and unique")
    elif blocks is not None:
        raise ValueError("`blocks` is only meaningful for group rounds")


def _check_slices(slices: list[list[int]] | None, blocks: list[int] | None) -> None:
    if slices is None:
        return
    named = [sl[0] for sl in slices]
    if blocks is None or len(set(named)) != len(named) or not set(named) <= set(blocks):
        raise ValueError("`slices` name distinct blocks of a group round's `blocks`")
    if any(sl[1] >= 8 or sl[2] >= sl[3] for sl in slices):
        raise ValueError("a slice is [block, dim < 8, start, stop > start]")


# ---- rounds, tasks, results ---------------------------------------------------------------------------


class _RoundFields(Message):
    """The fields a probe round and each of its tasks share, under one name each from the trainer
    (trainer.zo.probes.RoundSpec: the same names, the batch in place of `run`/`batch_sha256`) through the
    round (`ProbeRound`) to the worker's task (`ProbeTask`, built by `ProbeTask.split`, never field by field).

    Evaluate L(theta_version +- eps z(seed); batch) for each seed. `batch_sha256` names a blob already
    uploaded (the batch travels once). `want_clean` asks for L0. Schema version 2 adds `blocks`: the sorted,
    unique canonical block indices of a `group` round (the worker checks them against its model's block
    count), and `slices`: those of its blocks that move only in part (BlockSlice); version 1 messages have no
    group kind. Raises ValidationError for repeated seeds and for fields
    the kind needs or forbids.
    """

    schema_version: Literal[1, 2] = 1
    run: RunId
    round_id: RoundId
    version: Version
    batch_sha256: Sha256Hex
    eps: ProbeEps
    distribution: Distribution
    seeds: list[Seed] = Field(min_length=1, max_length=MAX_SEEDS_PER_ROUND)
    want_clean: bool = False
    kind: ProbeKindName = "seeded"
    base_version: Version | None = None
    blocks: list[BlockIndex] | None = Field(default=None, min_length=1, max_length=MAX_BLOCKS)
    slices: list[BlockSlice] | None = Field(default=None, min_length=1, max_length=MAX_BLOCKS)

    @model_serializer(mode="wrap")
    def _drop_absent_blocks(self, handler: SerializerFunctionWrapHandler) -> dict:
        """A schema-1 message serialises without the schema-2 `blocks` and `slices` fields, byte-identical to
        what workers and trainers of schema 1 send and accept (they forbid unknown fields, even null ones)."""
        out = handler(self)
        for key in ("blocks", "slices"):
            if out.get(key, 0) is None:
                del out[key]
        return out

    @model_validator(mode="after")
    def _check(self) -> _RoundFields:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds of a round must be unique")
        _check_kind(self.kind, self.version, self.base_version, self.blocks, self.schema_version)
        _check_slices(self.slices, self.blocks)
        check_line_seeds(self.kind, self.seeds, self.eps)
        return self


class ProbeRound(_RoundFields):
    """`POST /v1/runs/{run}/rounds` body: one round of probes (fields: `_RoundFields`)."""


class RoundInfo(Message):
    """Reply of round creation / `GET .../rounds/{round_id}`: task counts and progress."""

    run: RunId
    round_id: RoundId
    version: Version
    state: Literal["open", "closed"]
    n_seeds: int
    n_spot_checks: int
    tasks_published: int
    done: int


class ProbeTask(_RoundFields):
    """Celery task kwargs (`sparecycles.probe`): a few seeds of one round (the round's fields, `_RoundFields`).

    `replica` 0 is the primary evaluation; 1 and 2 are spot-check re-evaluations (must come from other
    workers). Tasks are idempotent: redelivery produces duplicates that intake drops.
    """

    seeds: list[Seed] = Field(min_length=1, max_length=MAX_SEEDS_PER_TASK)
    want_clean: bool  # required: a task states it (the dispatcher always does)
    replica: int = Field(default=0, ge=0, le=2)

    @classmethod
    def split(cls, rnd: ProbeRound, seeds: list[int], replica: int, per_task: int) -> list[ProbeTask]:
        """Tasks of at most `per_task` of `seeds` (in order) of round `rnd`, as replica `replica`: every other
        field is the round's (one dump of the round, so a field added to `_RoundFields` travels unasked)."""
        shared = rnd.model_dump(exclude={"seeds"})
        return [cls(**shared, seeds=seeds[i : i + per_task], replica=replica)
                for i in range(0, len(seeds), per_task)]


class ProbeResult(Message):
    """One seed's losses: l_plus = L(theta + eps z), l_minus = L(theta - eps z), l0 = L(theta).

    Validation refuses non-finite losses; a worker whose evaluation gave one reports it anyway (built
    with `non_finite_result`, serialised as a JSON `NaN`/`Infinity` token) and intake counts it
    `non_finite` and re-issues the seed.
    """

    model_config = ConfigDict(**Message.model_config, ser_json_inf_nan="constants")

    run: RunId
    round_id: RoundId
    seed: Seed
    version: Version
    worker_id: WorkerId
    replica: int = Field(default=0, ge=0, le=2)
    l_plus: FiniteFloat
    l_minus: FiniteFloat
    l0: FiniteFloat | None = None


class ResultBatch(Message):
    """`POST /v1/runs/{run}/results` body: the results of one task (or a few), one worker, one round."""

    results: list[ProbeResult] = Field(min_length=1, max_length=MAX_RESULTS_PER_BATCH)


class ResultEnvelope(Message):
    """What intake parses first: a `ResultBatch` whose entries are still unchecked JSON values.

    Each entry is then validated on its own (`parse_result`), so one bad entry costs only its own
    result (outcome `malformed` or `non_finite`), not the batch. JSON `NaN`/`Infinity` tokens are read.
    """

    model_config = ConfigDict(**Message.model_config | {"allow_inf_nan": True})
    results: list[JsonValue] = Field(min_length=1, max_length=MAX_RESULTS_PER_BATCH)


def non_finite_result(**fields: object) -> ProbeResult:
    """A `ProbeResult` carrying a non-finite loss, built without validation so it can be reported as such.

    Raises ValueError if every loss is finite (then build a `ProbeResult` normally) or if the rest of the
    fields do not validate.
    """
    losses = {k: fields.get(k) for k in ("l_plus", "l_minus", "l0")}
    if all(v is None or math.isfinite(v) for v in losses.values()):
        raise ValueError("every loss is finite: build a ProbeResult")
    ProbeResult.model_validate({**fields, **{k: 0.0 for k, v in losses.items() if v is not None}})
    return ProbeResult.model_construct(**{"replica": 0, "l0": None, **fields})


def parse_result(entry: JsonValue) -> tuple[ProbeResult | None, str]:
    """Validate one entry of a `ResultEnvelope`: (result, "") if valid; (result built as reported,
    "non_finite") if only its losses are NaN or infinite; (None, "malformed") otherwise."""
    try:
        return ProbeResult.model_validate(entry), ""
    except ValueError as exc:  # pydantic.ValidationError
        errors = exc.errors() if hasattr(exc, "errors") else []
    if isinstance(entry, dict) and errors and all(e["type"] == "finite_number" for e in errors):
        try:
            return non_finite_result(**entry), "non_finite"
        except (ValueError, TypeError):
            pass
    return None, "malformed"


IntakeOutcome = Literal[
    "accepted",
    "held",
    "duplicate",
    "stale",
    "invalid",
    "unknown_round",
    "closed_round",
    "unknown_seed",
    "quarantined",
    "unattested",
    "same_worker",
    "non_finite",
    "malformed",
]
INTAKE_OUTCOMES: tuple[str, ...] = IntakeOutcome.__args__  # type: ignore[attr-defined]


class IntakeReply(Message):
    """Per-result outcomes of a `ResultBatch`, in order. `held` = spot-check value awaiting its twin."""

    outcomes: list[IntakeOutcome]


class StreamEvent(Message):
    """An entry of the run's accepted-results stream read by the trainer.

    kind `accepted`: `result` is usable. `retracted`: a previously accepted result of a quarantined
    worker must be discarded (a fresh evaluation of the seed follows). `dropped`: spot-check replicas
    disagreed with no majority; the seed will not be delivered.
    """

    kind: Literal["accepted", "retracted", "dropped"]
    run: RunId
    round_id: RoundId
    seed: Seed
    result: ProbeResult | None = None
    verified: bool = False


def values_agree(a: ProbeResult, b: ProbeResult, rtol: float, atol: float) -> bool:
    """True if l_plus, l_minus (and l0 when both have it) agree: |x - y| <= atol + rtol * max(|x|, |y|).

    Pure function of two results and the tolerances (numpy.isclose-style but symmetric).
    """
    pairs = [(a.l_plus, b.l_plus), (a.l_minus, b.l_minus)]
    if a.l0 is not None and b.l0 is not None:
        pairs.append((a.l0, b.l0))
    return all(math.fabs(x - y) <= atol + rtol * max(math.fabs(x), math.fabs(y)) for x, y in pairs)
