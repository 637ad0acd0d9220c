"""Probe kinds, canonical blocks and the trainer's round/result types: the one meaning of every probe.

A probe of seed s at step ε evaluates L(θ_v ± ε·z) on a round's batch (DESIGN.md §1-§3). The *kind* says
what z is; `KINDS` holds one entry per kind, and both the in-process backend (trainer.zo.backend) and the
fleet's workers (probe_worker.runtime) evaluate a seed through `probe_losses`, which is what makes fleet
results bit-identical to in-process ones.

- ``seeded``: z(seed) of `dist` over all canonical parameters (probe_kernels.ProbeEvaluator, hooks, no copy).
- ``block_scaled``: z = Σ_b a_b r_b with a = estimators.block_scales(seed) (gauss8, one per block) and r
  the Rademacher stream of estimators.block_sign_seed(seed) at each element's global offset; block b
  becomes probe_kernels.perturb(w_b, sign_seed, offset_b, ±ε·a_b, "rademacher") (per-block curvature, §2).
- ``along_update``: the seed is a block index b; u_b = θ_v[b] − θ_base[b] in fp32, scale = ‖u_b‖/√n_b
  (norm in float64, `update_rms`), and block b becomes (w_b ± ε·u_b/scale) rounded once to its dtype (unit
  RMS, so ε means what it means for a unit-variance z). A block that did not move (scale 0) gives
  L+ = L− = L0. The result carries `scale` so the caller converts back to step units (ZO-Curv (c)).
- ``group``: z(seed) of `dist` restricted to the canonical blocks G of the round (`group`, sorted block
  indices), every other block unperturbed: block b ∈ G becomes probe_kernels.perturb(w_b, seed, offset_b, ±ε,
  dist). For a quadratic, h = (L+ + L− − 2L0)/ε² = z_Gᵀ H_GG z_G, so E[h] = tr(H_GG) for a unit-variance z
  and tr(H_GG)/n_G estimates the group's mean curvature (ZO-Curv by parameter group). A round's `slices`
  restrict some of its blocks further to a slice along one dimension (block, dim, start, stop): z is zero
  outside it, e.g. GPT-2's fused c_attn whose QK and V columns belong to different roles (trainer.zo.groups).
- ``line``: the seed j >= 1 is a step multiple along the whole multi-step update d = θ_v − θ_base (every
  block at once, fp32, not normalised): L± = L(θ_v ± j·ε·d), each block (w_b ± (j·ε)·d_b) rounded once to
  its dtype. With ε = ½ and seeds (1, 2, 3) a round gives the losses at α ∈ {±½, ±1, ±1½} along d that
  zocurv-global's quadratic line fit takes (trainer.zo.role_rules; α = −1 is θ_base itself up to rounding).
- ``group_line``: one designed point per seed along a parameter role's share of d = θ_v − θ_base: the seed names a
  signed step multiple k ≠ 0 (zigzag, wire.round_messages.line_multiple), α = k·ε, and only the round's
  blocks G move, those with a slice only there: block b ∈ G becomes (w_b + α·d_b) in fp32, rounded once to its
  dtype, where its slice (if any) says, w_b elsewhere (`group_line_weights`). L+ = L− = L(θ_v + α·d_G) (the point
  has no mirror; the pair keeps the result's shape). The role's segments travel as the round's `blocks` and
  `slices` (trainer.zo.groups.GroupMap.probe_fields), so a worker needs no role table. With ε = ½, seeds
  (1, 2, 4) and L0 a round gives α ∈ {−½, 0, ½, 1}, the calibrated trust region's design (trainer.zo.group_line).

Non-seeded kinds build perturbed blocks out of place (fp32 math, one rounding to the parameter dtype) and
swap them in (`param.data = new`) for one forward pass only; the clean storages are never written.
Canonical blocks are `model.named_parameters()` in order (tied weights once) with the global flat offsets
of probe_kernels.canonical_offsets, the one place offsets are computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from probe_kernels import perturb
from trainer.zo import estimators as est
from trainer.zo.probe_types import (  # noqa: F401  (public here too: the import path callers use)
    Block,
    BlockSlice,
    ProbeFitError,
    ProbeKind,
    SeedResult,
    Slices,
    block_sizes,
    canonical_blocks,
    check_fits,
    check_group,
    check_slices,
)
from wire.bounds import ProbeEps, check
from wire.round_messages import ProbeRound, check_line_seeds, line_multiple


@dataclass(frozen=True)
class RoundSpec:
    """One round of probes sharing a batch and a clean loss (common random numbers), as the trainer holds it.

    The wire form the coordinator receives is wire.round_messages.ProbeRound (batch by content hash).

    Attributes:
        round_id: unique name of the round.
        version: weight version θ_v the probes are taken at.
        batch: task batch passed to the loss function as is (in process: tensors).
        eps: probe step ε > 0 (parameter units, for a unit-RMS direction).
        seeds: probe seeds (``along_update``: block indices; ``line``: step multiples j >= 1; ``group_line``: signed
            step multiples, zigzag-coded).
        distribution: "rademacher" or "gauss8" (``seeded`` and ``group``).
        want_clean: also evaluate L0 = L(θ_v).
        kind: a ProbeKind.
        base_version: θ_base for ``along_update`` (usually version − 1), ``line`` and ``group_line`` (an earlier
            refresh).
        blocks: sorted, distinct canonical block indices perturbed by a ``group`` or ``group_line`` round (empty
            otherwise).
        slices: (block, dim, start, stop) of the blocks of `blocks` such a round perturbs only in part:
            elements with index in [start, stop) along `dim`; every other block of `blocks` whole.
        eval: the wire.round_messages.EvalSpec of an ``eval`` round (held-out batches, fleet.evaluation; the
            seeds are batch indices), None otherwise.
    The field names are the wire's (wire.round_messages.ProbeRound), so `to_wire` copies none by hand.
    Raises ValueError at construction for an empty or repeated seed list, eps outside ProbeEps, and fields
    the kind needs or forbids (`check_kind_fields`).
    """

    round_id: str
    version: int
    batch: Any
    eps: float
    seeds: tuple[int, ...]
    distribution: str = "rademacher"
    want_clean: bool = False
    kind: ProbeKind = ProbeKind.SEEDED
    base_version: int | None = None
    blocks: tuple[int, ...] = ()
    slices: tuple[BlockSlice, ...] = ()
    eval: Any = None

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("a probe round needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds of a round must be distinct (results are deduplicated by (round, seed))")
        check(ProbeEps, self.eps)
        check_kind_fields(ProbeKind(self.kind), self.base_version, self.blocks)
        check_slices(self.slices, self.blocks)
        if (ProbeKind(self.kind) is ProbeKind.EVAL) != (self.eval is not None):
            raise ValueError("an eval round (and only an eval round) carries its EvalSpec")
        check_line_seeds(ProbeKind(self.kind).value, list(self.seeds), self.eps)  # the wire's bound, refused here

    def to_wire(self, run: str, batch_sha256: str) -> ProbeRound:
        """This round as the coordinator receives it, its batch uploaded as blob `batch_sha256`: every field
        but `batch` under its own name (JSON types: lists, the kind's wire name), schema 2 only for rounds with
        `blocks` (and `slices`: group and group_line), 3 for eval rounds (`eval`). Raises pydantic.ValidationError
        for what the wire refuses (e.g. a round id)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "batch"}
        fields.update(eps=float(self.eps), distribution=str(self.distribution), seeds=[int(x) for x in self.seeds],
                      kind=ProbeKind(self.kind).value, blocks=[int(b) for b in self.blocks] or None,
                      schema_version=3 if self.eval is not None else 2 if self.blocks else 1,
                      slices=[[int(x) for x in sl] for sl in self.slices] or None)
        return ProbeRound(run=run, batch_sha256=batch_sha256, **fields)


# ---- evaluating one seed ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeSite:
    """Where probes of one round run: the model's blocks at θ_v and how to evaluate losses there.

    Attributes:
        blocks: canonical blocks of the model holding θ_v.
        loss: loss(new) -> L (nats) with blocks `new` {index: tensor} swapped in; None or {} = clean.
        seeded_loss: seeded_loss(seed, alpha, dist) -> L(θ_v + alpha·z(seed)) (probe_kernels.ProbeEvaluator).
        update: update(b) -> u_b = θ_v[b] − θ_base[b], fp32 of block b's shape (along_update, line and
            group_line rounds only).
    """

    blocks: Sequence[Block]
    loss: Callable[[Mapping[int, torch.Tensor] | None], float]
    seeded_loss: Callable[[int, float, str], float]
    update: Callable[[int], torch.Tensor] | None = None



Losses = tuple[float, float, float | None]  # (L+, L−, scale or None)


def _seeded(site: ProbeSite, seed: int, eps: float, dist: str, group: Sequence[int], l0: float | None,
            slices: Slices = ()) -> Losses:
    return site.seeded_loss(seed, eps, dist), site.seeded_loss(seed, -eps, dist), None


def block_scaled_weights(blocks: Sequence[Block], seed: int, alpha: float) -> dict[int, torch.Tensor]:
    """Every block of θ + alpha·z_block_scaled(seed), out of place, each in its parameter's dtype."""
    a = est.block_scales(seed, len(blocks))
    rs = est.block_sign_seed(seed)
    return {i: perturb(b.param.detach(), rs, b.offset, alpha * float(a[i]), "rademacher")
            for i, b in enumerate(blocks)}


def _block_scaled(site: ProbeSite, seed: int, eps: float, dist: str, group: Sequence[int],
                  l0: float | None, slices: Slices = ()) -> Losses:
    return (site.loss(block_scaled_weights(site.blocks, seed, eps)),
            site.loss(block_scaled_weights(site.blocks, seed, -eps)), None)


def update_rms(u: torch.Tensor) -> float:
    """‖u‖/√n of a block update u (any shape, fp32), the norm in float64: the along-update `scale`."""
    return float(torch.linalg.vector_norm(u.double())) / math.sqrt(u.numel())


def _along_update(site: ProbeSite, b: int, eps: float, dist: str, group: Sequence[int], l0: float | None,
            slices: Slices = ()) -> Losses:
    if site.update is None:
        raise ValueError("along_update probes need the base version's weights (ProbeSite.update)")
    if not 0 <= b < len(site.blocks):
        raise ProbeFitError(f"block index {b} out of range [0, {len(site.blocks)})")
    w = site.blocks[b].param.detach()
    u = site.update(b)
    if u.shape != w.shape:
        raise ProbeFitError(f"block {b} has shape {tuple(w.shape)} in one version, {tuple(u.shape)} in the other")
    scale = update_rms(u)
    if scale == 0.0:
        base = l0 if l0 is not None else site.loss(None)
        return base, base, 0.0
    uhat = u / scale
    lp = site.loss({b: (w.float() + eps * uhat).to(w.dtype)})
    lm = site.loss({b: (w.float() - eps * uhat).to(w.dtype)})
    return lp, lm, scale


def slice_mask(shape: Sequence[int], dim: int, start: int, stop: int, device=None) -> torch.Tensor:
    """Bool tensor of `shape`, True on the elements with index in [start, stop) along `dim`."""
    m = torch.zeros(tuple(shape), dtype=torch.bool, device=device)
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, stop)
    m[tuple(idx)] = True
    return m


def group_weights(blocks: Sequence[Block], group: Sequence[int], seed: int, alpha: float, dist: str,
                  slices: Slices = ()) -> dict[int, torch.Tensor]:
    """Blocks `group` of θ + alpha·z(seed) (z of `dist` at each block's global offset), out of place; a block with
    a slice (block, dim, start, stop) in `slices` moves only there (z is zero elsewhere, the rest bit-identical).

    Raises ValueError unless `group` is a non-empty, sorted, duplicate-free list of block indices and every slice
    names a block of `group` once, within its shape.
    """
    check_group(group, len(blocks))
    check_slices(slices, group)
    return _keep_slices({i: perturb(blocks[i].param.detach(), seed, blocks[i].offset, alpha, dist) for i in group},
                        blocks, slices)


def _keep_slices(moved: dict[int, torch.Tensor], blocks: Sequence[Block], slices: Slices) -> dict[int, torch.Tensor]:
    """`moved` with each sliced block moved only inside its slice (the rest of it the block's own weights, bit for
    bit). Raises ProbeFitError for a slice outside its block's shape."""
    for b, dim, start, stop in slices:
        w = blocks[b].param.detach()
        if not (0 <= dim < w.dim() and stop <= w.shape[dim]):
            raise ProbeFitError(f"slice ({b}, {dim}, {start}, {stop}) outside block {b} of shape {tuple(w.shape)}")
        moved[b] = torch.where(slice_mask(w.shape, dim, start, stop, w.device), moved[b], w)
    return moved


def _group(site: ProbeSite, seed: int, eps: float, dist: str, group: Sequence[int], l0: float | None,
           slices: Slices = ()) -> Losses:
    return (site.loss(group_weights(site.blocks, group, seed, eps, dist, slices)),
            site.loss(group_weights(site.blocks, group, seed, -eps, dist, slices)), None)


def _moved(site: ProbeSite, b: int, alpha: float, kind: str) -> torch.Tensor:
    """Block b of θ_v + alpha·d (d = site.update(b), fp32): (w_b + alpha·d_b) in fp32, rounded once to its dtype."""
    if site.update is None:
        raise ValueError(f"{kind} probes need the base version's weights (ProbeSite.update)")
    w = site.blocks[b].param.detach()
    d = site.update(b)
    if d.shape != w.shape:
        raise ProbeFitError(f"block {b} has shape {tuple(w.shape)} in one version, {tuple(d.shape)} in the other")
    return (w.float() + alpha * d).to(w.dtype)


def line_weights(site: ProbeSite, alpha: float) -> dict[int, torch.Tensor]:
    """Every block of θ_v + alpha·d, d = θ_v − θ_base (site.update), out of place: (w_b + alpha·d_b) in fp32,
    rounded once to the block's dtype. Raises ValueError without base weights or for a block of another shape."""
    return {b: _moved(site, b, alpha, "line") for b in range(len(site.blocks))}


def _line(site: ProbeSite, j: int, eps: float, dist: str, group: Sequence[int], l0: float | None,
            slices: Slices = ()) -> Losses:
    if j < 1:
        raise ValueError(f"line seeds are step multiples j >= 1, got {j}")
    a = j * eps
    return site.loss(line_weights(site, a)), site.loss(line_weights(site, -a)), None


def group_line_weights(site: ProbeSite, group: Sequence[int], slices: Slices,
                       alpha: float) -> dict[int, torch.Tensor]:
    """Blocks `group` of θ_v + alpha·d (d = θ_v − θ_base, site.update), out of place: (w_b + alpha·d_b) in fp32,
    rounded once to the block's dtype; a block with a slice (block, dim, start, stop) moves only there (the rest of
    it bit-identical to w_b). Every block outside `group` stays clean (not in the result).

    Raises ValueError without base weights, for a group or slices `check_group` / `check_slices` refuse, a block of
    another shape in the two versions, or a slice outside its block's shape.
    """
    check_group(group, len(site.blocks))
    check_slices(slices, group)
    return _keep_slices({b: _moved(site, b, alpha, "group_line") for b in group}, site.blocks, slices)


def _group_line(site: ProbeSite, seed: int, eps: float, dist: str, group: Sequence[int], l0: float | None,
                slices: Slices = ()) -> Losses:
    k = line_multiple(seed)
    if k == 0:
        raise ValueError("group_line seed 0 names θ_v itself: ask for the clean loss (want_clean) instead")
    value = site.loss(group_line_weights(site, group, slices, k * eps))
    return value, value, None


@dataclass(frozen=True)
class KindRule:
    """One probe kind: how a seed is evaluated and which round fields it needs.

    evaluate(site, seed, eps, dist, group, l0, slices) -> (L+, L−, scale or None).
    """

    evaluate: Callable[[ProbeSite, int, float, str, Sequence[int], float | None, Slices], Losses]
    needs_base: bool = False  # the round names base_version (along_update, line, group_line)
    needs_group: bool = False  # the round names its block group (group, group_line)
    forwards: int = 2  # forward passes per seed (L+ and L−; group_line: its one point)
    # The forward's precision on a GPU worker, declared from measurement (`sparecycles bench precision`, the table
    # in docs/RESULTS.md): "bf16" (the bf16 compiled fast path, probe_kernels.FastForward) only where the bf16 forward's
    # signal-to-noise at the kind's ε clears SNR_BOUND; else "tf32" (fp32 weights, TF32 matmuls).
    precision: Literal["bf16", "tf32"] = "tf32"


def _eval(site: ProbeSite, k: int, eps: float, dist: str, group: Sequence[int], l0: float | None) -> Losses:
    raise ValueError("eval rounds perturb nothing: their batches are scored by trainer.evaluation.batch_values")


# Adding a kind: a ProbeKind member and one entry here (the wire name in wire.messages.ProbeKindName
# is checked against this table by tests/trainer/test_zo_probes.py).
KINDS: dict[ProbeKind, KindRule] = {
    ProbeKind.SEEDED: KindRule(_seeded),
    ProbeKind.BLOCK_SCALED: KindRule(_block_scaled),
    ProbeKind.ALONG_UPDATE: KindRule(_along_update, needs_base=True),
    ProbeKind.GROUP: KindRule(_group, needs_group=True),
    ProbeKind.LINE: KindRule(_line, needs_base=True, precision="bf16"),
    ProbeKind.GROUP_LINE: KindRule(_group_line, needs_base=True, needs_group=True, forwards=1, precision="bf16"),
    ProbeKind.EVAL: KindRule(_eval, precision="bf16"),  # held-out evaluation (wire.messages.EvalSpec), not a probe
}

# A kind runs its forward in bf16 only when the bf16 forward's loss-difference signal-to-noise ratio (rms of the
# fp32 reference's signal over the rms of bf16's deviation from it, benchmarks.precision) is at least this: bf16
# then moves the quantity the round measures by at most a tenth of its typical size.
SNR_BOUND = 10.0


def forward_dtype(kind: ProbeKind | str, device: str | torch.device) -> torch.dtype | None:
    """The dtype a worker's forward for `kind` runs in on `device`: torch.bfloat16 for a kind declared "bf16"
    (KINDS) on CUDA, None (the version's own dtype, fp32 with TF32 matmuls on CUDA) otherwise; on CPU always
    None, so a CPU worker's values equal the trainer's bit for bit. Raises ValueError for an unknown kind."""
    rule = KINDS[ProbeKind(kind)]
    return torch.bfloat16 if rule.precision == "bf16" and torch.device(device).type == "cuda" else None


def check_kind_fields(kind: ProbeKind, base_version: int | None, group: Sequence[int]) -> None:
    """Raise ValueError when a round lacks a field its kind needs (KINDS) or carries one it does not use."""
    rule = KINDS[kind]
    if rule.needs_base and base_version is None:
        raise ValueError(f"{kind.value} rounds need base_version (the version the update started from)")
    if not rule.needs_base and base_version is not None:
        raise ValueError(f"base_version is only meaningful for along_update, line and group_line rounds, not "
                         f"{kind.value}")
    if rule.needs_group:
        check_group(group)
    elif group:
        raise ValueError(f"a block group is only meaningful for group and group_line rounds, not {kind.value}")


def probe_losses(site: ProbeSite, kind: ProbeKind | str, seed: int, eps: float, dist: str,
                 group: Sequence[int] = (), l0: float | None = None, slices: Slices = ()) -> Losses:
    """(L+, L−, scale or None) of one seed of a round of `kind` at `site` (the table `KINDS`).

    Raises ValueError for an unknown kind, a block index out of range, or missing base weights.
    """
    return KINDS[ProbeKind(kind)].evaluate(site, int(seed), float(eps), str(dist), group, l0, slices)


# ---- swapping blocks in for one forward pass ----------------------------------------------------------------


@contextlib.contextmanager
def swapped(blocks: Sequence[Block], new: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Point block i's `.data` at new[i] for the duration; restore the original storages afterwards."""
    saved = {i: blocks[i].param.data for i in new}
    try:
        for i, t in new.items():
            blocks[i].param.data = t
        yield
    finally:
        for i, t in saved.items():
            blocks[i].param.data = t


@torch.no_grad()
def swapped_loss(model: torch.nn.Module, blocks: Sequence[Block],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                 new: Mapping[int, torch.Tensor] | None) -> float:
    """loss_fn(model, batch) as a float with blocks `new` swapped in (None: the clean model)."""
    with swapped(blocks, new or {}):
        return float(loss_fn(model, batch))
