"""The probe round's message family (DESIGN.md section 3): `ProbeRound` (trainer -> coordinator), its
`ProbeTask`s (coordinator -> worker, `ProbeTask.split`), `ProbeResult`s in `ResultBatch`es (worker ->
coordinator), the intake's `IntakeReply` and the results stream's `StreamEvent` (coordinator -> trainer).
Strict, frozen, versioned pydantic models on wire.messages' base; one field name end to end (the
trainer's trainer.zo.probes.RoundSpec uses the same names).
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

from pydantic import (
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from wire.bounds import ProbeEps, Seed, TaskSeconds
from wire.messages import (
    BASE_KINDS,
    GROUP_KINDS,
    MAX_BLOCKS,
    MAX_RESULTS_PER_BATCH,
    MAX_SEEDS_PER_ROUND,
    MAX_SEEDS_PER_TASK,
    BlockIndex,
    BlockSlice,
    Distribution,
    FiniteFloat,
    Message,
    Part,
    ProbeKindName,
    RoundId,
    RunId,
    Sha256Hex,
    Version,
    WorkerId,
)

MAX_LINE_SEED = 64  # a `line` seed j is the step multiple α = ±j·eps along θ_version − θ_base (|k| of `group_line`)
MAX_LINE_STEP = 16.0  # j·eps: further than 16 updates along the line is no curvature probe, and overflows


def line_multiple(seed: int) -> int:
    """The signed step multiple k a `group_line` seed names, zigzag-coded (seed 2k for k > 0, 2|k| − 1 for k < 0:
    seeds 1, 2, 3, 4 are k = −1, +1, −2, +2); the probe is at α = k·eps. Seed 0 (k = 0, θ_version itself) is no
    probe: the clean loss is the round's `want_clean`. Pure; raises ValueError for a negative seed."""
    if seed < 0:
        raise ValueError(f"a group_line seed is >= 0, got {seed}")
    return seed // 2 if seed % 2 == 0 else -(seed + 1) // 2


def line_seed(k: int) -> int:
    """The `group_line` seed of signed step multiple k (the inverse of `line_multiple`). Pure."""
    return 2 * k if k >= 0 else -2 * k - 1


def check_line_seeds(kind: str, seeds: list[int], eps: float) -> None:
    """A `line` round's seeds are step multiples 1 <= j <= MAX_LINE_SEED with j·eps <= MAX_LINE_STEP (a worker
    would refuse a seed 0 only after dispatch, and a huge j·eps gives non-finite losses); a `group_line` round's
    seeds name signed multiples k (`line_multiple`) with 1 <= |k| <= MAX_LINE_SEED under the same bound on |k|·eps.
    Other kinds pass. Raises ValueError naming the bound."""
    if kind == "group_line":
        ks = [abs(line_multiple(s)) for s in seeds]
        if min(ks) < 1 or max(ks) > MAX_LINE_SEED:
            raise ValueError(f"group_line seeds name signed step multiples 1 <= |k| <= {MAX_LINE_SEED} (zigzag: "
                             f"seeds 1..{line_seed(MAX_LINE_SEED)}; seed 0 is the clean loss, want_clean), got "
                             f"{min(seeds)}..{max(seeds)}")
        if max(ks) * eps > MAX_LINE_STEP:
            raise ValueError(f"group_line probes reach |k|*eps = {max(ks) * eps:g} > {MAX_LINE_STEP:g} updates "
                             "along the line")
        return
    if kind != "line":
        return
    if min(seeds) < 1 or max(seeds) > MAX_LINE_SEED:
        raise ValueError(f"line seeds are step multiples 1..{MAX_LINE_SEED}, got {min(seeds)}..{max(seeds)}")
    if max(seeds) * eps > MAX_LINE_STEP:
        raise ValueError(f"line probes reach j*eps = {max(seeds) * eps:g} > {MAX_LINE_STEP:g} updates along the line")


MAX_EVAL_TERMS = 16  # versions in one weight mixture of an evaluation
MAX_EVAL_BATCHES = 1 << 20  # evaluation batches of one split


class WeightTerm(Part):
    """One term of the weights an evaluation scores: `coeff` times the published version `version`."""

    version: Version
    coeff: FiniteFloat = Field(ge=-1e3, le=1e3)


class EvalSpec(Part):
    """What an `eval` round scores (schema 3): the weights, as a small mixture of published versions
    (θ = Σ coeff_i · θ_{version_i}, built by the worker with trainer.anytime.ring.build_mixture; coefficients sum to 1), and
    the held-out windows, named by `split` (e.g. "classics-small/val": the trainer's selection, uploaded once as the
    round's batch blob) in batches of `batch_size` rows; the round's seeds are the batch indices it covers.

    Per result (ProbeResult of an eval round): `l_plus` is the batch's loss (causal LM: mean nats/token;
    classifier: summed nats over the batch's sentences), `l_minus` the sentences classified right (classifier;
    0.0 for a causal LM), `l0` absent (trainer.evaluation.batch_values, the trainer's own code).
    """

    split: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,63}$")]
    batch_size: int = Field(ge=1, le=65_536)
    weights: list[WeightTerm] = Field(min_length=1, max_length=MAX_EVAL_TERMS)

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        if len({t.version for t in self.weights}) != len(self.weights):
            raise ValueError("the versions of a weight mixture must be distinct")
        return self


def _check_eval(kind: str, version: int, seeds: list[int], spec: EvalSpec | None, schema_version: int) -> None:
    if kind != "eval":
        if spec is not None:
            raise ValueError("`eval` is only meaningful for eval rounds")
        return
    if schema_version < 3 or spec is None:
        raise ValueError("an eval round needs schema_version 3 and its `eval` spec")
    if max(t.version for t in spec.weights) != version:
        raise ValueError("an eval round's version is the newest version of its weights")
    if max(seeds) >= MAX_EVAL_BATCHES:
        raise ValueError(f"eval seeds are batch indices below {MAX_EVAL_BATCHES}")


def _check_kind(kind: str, version: int, base_version: int | None, blocks: list[int] | None,
                schema_version: int) -> None:
    if kind in BASE_KINDS:
        if base_version is None or base_version >= version:
            raise ValueError(f"{kind} rounds need base_version < version")
    elif base_version is not None:
        raise ValueError(f"base_version is only meaningful for {', '.join(BASE_KINDS)} rounds, not {kind}")
    if kind in GROUP_KINDS:
        if schema_version < 2 or not blocks:
            raise ValueError(f"a {kind} round needs schema_version 2 and a non-empty `blocks` list")
        if any(a >= b for a, b in itertools.pairwise(blocks)):
            raise ValueError(f"{kind} blocks must be sorted and unique")
    elif blocks is not None:
        raise ValueError(f"`blocks` is only meaningful for {' and '.join(GROUP_KINDS)} rounds, not {kind}")


def _check_slices(slices: list[list[int]] | None, blocks: list[int] | None) -> None:
    if slices is None:
        return
    named = [sl[0] for sl in slices]
    if blocks is None or len(set(named)) != len(named) or not set(named) <= set(blocks):
        raise ValueError("`slices` name distinct blocks of a group or group_line round's `blocks`")
    if any(sl[1] >= 8 or sl[2] >= sl[3] for sl in slices):
        raise ValueError("a slice is [block, dim < 8, start, stop > start]")


# ---- rounds, tasks, results ---------------------------------------------------------------------------


class _RoundFields(Message):
    """The fields a probe round and each of its tasks share, under one name each from the trainer
    (trainer.zo.probes.RoundSpec: the same names, the batch in place of `run`/`batch_sha256`) through the
    round (`ProbeRound`) to the worker's task (`ProbeTask`, built by `ProbeTask.split`, never field by field).

    Evaluate L(theta_version +- eps z(seed); batch) for each seed. `batch_sha256` names a blob already
    uploaded (the batch travels once). `want_clean` asks for L0. Schema version 2 adds `blocks`: the sorted,
    unique canonical block indices of a `group` or `group_line` round (the worker checks them against its model's
    block count), and `slices`: those of its blocks that move only in part (BlockSlice); version 1 messages have
    no group kinds. A `group_line` round (a parameter role's share of θ_version − θ_base, e.g. GPT-2's QK columns
    of c_attn) names its role by these segments, so the worker needs no role table; its seeds are one designed
    point each (`line_multiple`).
    Schema version 3 adds `eval` (EvalSpec) for `eval` rounds: held-out evaluation batches, one per
    seed (`eps` and `distribution` unused there). Raises ValidationError for repeated seeds and for fields
    the kind needs or forbids.
    """

    schema_version: Literal[1, 2, 3] = 1
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
    eval: EvalSpec | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_blocks(self, handler: SerializerFunctionWrapHandler) -> dict:
        """A message serialises without the schema-2 `blocks` and `slices` and the schema-3 `eval` fields when they
        are absent, byte-identical to what workers and trainers of older schemas send and accept (they forbid
        unknown fields, even null ones)."""
        out = handler(self)
        for key in ("blocks", "slices", "eval"):
            if out.get(key, 0) is None:
                del out[key]
        return out

    @model_validator(mode="after")
    def _check(self) -> _RoundFields:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds of a round must be unique")
        _check_kind(self.kind, self.version, self.base_version, self.blocks, self.schema_version)
        _check_slices(self.slices, self.blocks)
        _check_eval(self.kind, self.version, self.seeds, self.eval, self.schema_version)
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


class _TaskTime(Message):
    """`task_s` (schema version 2): the task's wall time on the worker, seconds (wire.bounds.TaskSeconds); the
    coordinator adds it to the run's worker-seconds (coordinator.shares). Absent in schema 1, and then not sent.
    Non-finite losses of its results serialise as JSON constants, as each `ProbeResult` does on its own."""

    model_config = ConfigDict(**Message.model_config, ser_json_inf_nan="constants")
    schema_version: Literal[1, 2] = 1
    task_s: TaskSeconds | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_time(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        if out.get("task_s", 0) is None:
            del out["task_s"]
        return out

    @model_validator(mode="after")
    def _check_time_schema(self) -> _TaskTime:
        if self.task_s is not None and self.schema_version < 2:
            raise ValueError("`task_s` needs schema_version 2")
        return self


class ResultBatch(_TaskTime):
    """`POST /v1/runs/{run}/results` body: the results of one task (or a few), one worker, one round, and the
    task's wall time (`task_s`, schema 2)."""

    results: list[ProbeResult] = Field(min_length=1, max_length=MAX_RESULTS_PER_BATCH)


class ResultEnvelope(_TaskTime):
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
    "unknown_run",
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
