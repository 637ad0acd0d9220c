"""Each setting's one bound, defined once: annotated pydantic types that the wire messages
(wire.messages), the trainer's config (trainer.config.TrainConfig) and trainer-side constructors
(through `check`) validate with. Torch-free, so every layer may import it.

ε has four meanings, each with its own name (only the first two are settings; the others are fixed):
- `ProbeEps`: the absolute probe step ε of L(θ ± ε·z), parameter units for a unit-RMS direction z: a round's
  `eps` on the wire and in trainer.zo.probes.RoundSpec, TrainConfig.eps of the pure-ZO and ZO-Curv methods.
- a step relative to a parameter group's weight RMS, ε_G = eps·RMS(θ_G): the role variants of ZO-Curv read
  TrainConfig.eps (a ProbeEps) this way; it has no type of its own.
- the `line` kind's step unit: a line round probes α = ±j·ε along θ_v − θ_base (a `group_line` round one α = k·ε
  per seed, k signed, along a role's share of it); the step is a ProbeEps and the product |j|·ε is bounded by
  MAX_LINE_SEED and MAX_LINE_STEP (wire.round_messages.check_line_seeds).
- Adam's ε: the denominator floor of Adam-family updates (torch.optim.AdamW's `eps`), never a probe step.

Seeds: a probe `Seed` is a Philox key, an unsigned 64-bit integer (DESIGN.md §1); a `RunSeed` is the base of
a run's derived seeds (trainer.zo.estimators.derive_seed), kept below 2**63 so every tensor library carries
it as a non-negative int64. `Staleness` S counts versions (the rule itself: wire.staleness). `KDIds` bounds the ids
per position of distillation targets (TrainConfig.kd_k, wire.teacher_messages, wire.kd_targets, an engine's answers).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter

PROBE_EPS = 1e-3  # the default probe step ε (TrainConfig.eps and the ZO optimizers' probe_eps)
MAX_PROBE_EPS = 1.0  # parameter units: a unit-RMS step of 1 already leaves the region a difference quotient sees
MAX_STALENESS = 1_000_000  # versions
SEED_LIMIT = 1 << 64  # probe seeds: [0, 2**64), the Philox key (probe_kernels.philox.SEED_LIMIT)
RUN_SEED_LIMIT = 1 << 63  # run seeds: [0, 2**63), a non-negative int64
MAX_KD_K = 1024  # distillation ids per position (S sampled, k topk): far above any useful S or k
MAX_SHARE = 1000.0  # a run's share of the pool (relative weight): 1000:1 already leaves the small run a worker
# for about a thousandth of the time, finer than a pool of a few workers can split
MAX_TASK_S = 86_400.0  # seconds a worker reports for one task: a day, far above any probe task

ProbeEps = Annotated[float, Field(gt=0.0, le=MAX_PROBE_EPS, allow_inf_nan=False)]
Staleness = Annotated[int, Field(ge=0, le=MAX_STALENESS)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
RunSeed = Annotated[int, Field(ge=0, lt=RUN_SEED_LIMIT)]
Share = Annotated[float, Field(gt=0.0, le=MAX_SHARE, allow_inf_nan=False)]  # --share: a run's weight in the pool
TaskSeconds = Annotated[float, Field(ge=0.0, le=MAX_TASK_S, allow_inf_nan=False)]  # one task's wall time
KDIds = Annotated[int, Field(ge=1, le=MAX_KD_K)]  # --kd-k, a teacher round's k, a target blob's K

_ADAPTERS: dict[int, TypeAdapter] = {}  # by id(bound): the types above live as long as the module


def check(bound: Any, value: Any) -> Any:
    """`value` validated against one of the types above (e.g. `check(ProbeEps, 1e-3)`), for trainer-side
    objects built outside a pydantic model. Raises pydantic.ValidationError (a ValueError) naming the bound."""
    adapter = _ADAPTERS.get(id(bound))
    if adapter is None:
        adapter = _ADAPTERS[id(bound)] = TypeAdapter(bound)
    return adapter.validate_python(value)


def check_share(share: Any) -> float:
    """`share` validated as a `Share` (a run's share of the pool). Raises ValueError naming the share and its bound."""
    try:
        return check(Share, share)
    except ValueError:
        raise ValueError(f"a share must be a finite number > 0 and <= {MAX_SHARE:g}, got {share!r}") from None
