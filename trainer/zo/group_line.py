"""Group-line probes: losses along one role's share of the displacement since the last refresh.

For role G (trainer.zo.groups: segments of canonical blocks) and d = θ_t − θ_prev, the probe at α moves only
G's elements: block b becomes w_b + α·d_b on G's segments of b (fp32 math, rounded once to the block's dtype)
and stays w_b elsewhere (GPT-2's c_attn: the QK columns move, the V columns do not, or the reverse). The
weights are built out of place and swapped in for one forward pass; the model's storages are never written.
This is the evaluation the calibrated trust region (trainer.zo.trust_region) fits.

Its one meaning is the ``group_line`` probe kind (trainer.zo.probes): a round per (held-out batch, role) names the
role by its segments (`blocks`, `slices`: GroupMap.probe_fields), θ_prev as `base_version`, and one designed point
α = k·ε per seed (signed step multiple k, zigzag-coded: wire.round_messages.line_seed); α = 0 is the round's
clean loss, asked of the first role's round of each batch only. So a refresh is `group_line_rounds` (any backend:
trainer.zo.backend.InProcessBackend, or fleet.backend.CoordinatorBackend's workers), its results become the
(B, J) loss table of each role with `group_line_table`, and `group_line_losses` evaluates the same rounds in
process on a model and an fp32 θ_prev (the reference the fleet's results equal bit for bit).

Cost per refresh: B·(1 + R·(J − 1)) forward passes for B batches, R roles and J designed points (α = 0 once
per batch, shared by every role).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.zo import probes
from trainer.zo.groups import GroupMap, Role
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult, canonical_blocks, swapped_loss
from wire.round_messages import line_seed

DESIGN_EPS = 0.5  # the step unit of trainer.zo.trust_region.DESIGN_ALPHAS: every designed α is a multiple of it


def design_seeds(alphas: Sequence[float], eps: float) -> dict[float, int]:
    """{α: its ``group_line`` seed} for every α ≠ 0 of `alphas` (α = k·eps, k an integer). Pure.

    Raises ValueError for repeated alphas or an α that is not an integer multiple of `eps`.
    """
    if len(set(alphas)) != len(alphas):
        raise ValueError(f"designed alphas must be distinct, got {list(alphas)}")
    out = {}
    for a in alphas:
        k = round(a / eps)
        if k * eps != a:
            raise ValueError(f"alpha {a} is not an integer multiple of the step eps = {eps}")
        if k:
            out[float(a)] = line_seed(k)
    return out


def round_id(prefix: str, version: int, batch: int, role: Role) -> str:
    """The id of the group-line round of (version, held-out batch index, role): "<prefix>-<version>-<batch>-<role>"
    (`group_line_table` reads the batch and the role back from it)."""
    return f"{prefix}-{version}-{batch}-{role.value}"


def group_line_rounds(gmap: GroupMap, batches: Sequence[Any], version: int, base_version: int,
                      alphas: Sequence[float], eps: float = DESIGN_EPS, prefix: str = "trust") -> list[RoundSpec]:
    """The ``group_line`` rounds of one refresh: per batch b (in order), per role of `gmap` (GroupMap.roles
    order), one round at `version` along θ_version − θ_base_version restricted to the role (its segments:
    GroupMap.probe_fields), seeds `design_seeds(alphas, eps)` (in `alphas` order), the clean loss asked of each
    batch's first round. B·R rounds of J − 1 seeds (α = 0 among the J `alphas`). Raises ValueError as design_seeds
    and RoundSpec do (e.g. base_version not below version)."""
    seeds = tuple(design_seeds(alphas, eps).values())
    out = []
    for b, batch in enumerate(batches):
        for i, role in enumerate(gmap.roles):
            blocks, slices = gmap.probe_fields(role)
            out.append(RoundSpec(round_id(prefix, version, b, role), version, batch, eps, seeds, want_clean=i == 0,
                                 kind=ProbeKind.GROUP_LINE, base_version=base_version, blocks=blocks, slices=slices))
    return out


def group_line_table(refresh: Sequence[tuple[RoundSpec, Sequence[SeedResult]]], alphas: Sequence[float],
                     eps: float = DESIGN_EPS) -> dict[Role, torch.Tensor]:
    """{role: (B, J) float64 losses L_b(θ_t + alphas[j]·d_G)} from one refresh's ``group_line`` rounds and results
    (`group_line_rounds`' ids; any order): α = 0 is the clean loss of batch b's round that wanted it, α ≠ 0 the
    result of its seed (L+ = L− for this kind). Rounds of other kinds are ignored.

    Raises ValueError when a batch has no clean loss, a (batch, role) has no round, or a round lacks a designed seed.
    """
    seeds = design_seeds(alphas, eps)
    rows: dict[tuple[int, Role], dict[int, float]] = {}
    clean: dict[int, float] = {}
    for r, res in refresh:
        if ProbeKind(r.kind) is not ProbeKind.GROUP_LINE:
            continue
        _, b, role = r.round_id.rsplit("-", 2)
        key = (int(b), Role(role))
        rows[key] = {x.seed: x.l_plus for x in res}
        if r.want_clean and res:
            clean[int(b)] = res[0].l0 if res[0].l0 is not None else _missing(r.round_id, "its clean loss")
    n = 1 + max((b for b, _ in rows), default=-1)
    roles = sorted({role for _, role in rows}, key=list(Role).index)
    out = {role: torch.empty(n, len(alphas), dtype=torch.float64) for role in roles}
    for b in range(n):
        if b not in clean:
            _missing(f"batch {b}", "a round with the clean loss")
        for role in roles:
            got = rows.get((b, role))
            if got is None:
                _missing(f"batch {b}", f"a {role.value} round")
            for j, a in enumerate(alphas):
                s = seeds.get(float(a))
                if s is not None and s not in got:
                    _missing(f"batch {b}, role {role.value}", f"the result of seed {s} (alpha {a})")
                out[role][b, j] = clean[b] if s is None else got[s]
    return out


def _missing(where: str, what: str) -> float:
    raise ValueError(f"group-line refresh: {where} lacks {what}")


def group_line_weights(params: Sequence[torch.Tensor], prev: Sequence[torch.Tensor], gmap: GroupMap, role: Role,
                       alpha: float) -> dict[int, torch.Tensor]:
    """{block index: weights} of θ_t + α·(θ_t − θ_prev) restricted to `role`'s segments, out of place
    (trainer.zo.probes.group_line_weights, the ``group_line`` kind's own).

    params: canonical blocks at θ_t (any dtype); prev: fp32 tensors of the same shapes at θ_prev.
    Raises ValueError for a shape mismatch.
    """
    blocks, slices = gmap.probe_fields(role)
    site = _site([probes.Block(str(i), p, 0) for i, p in enumerate(params)], prev, lambda new: float("nan"))
    return probes.group_line_weights(site, blocks, slices, alpha)


def _site(blocks: Sequence[probes.Block], prev: Sequence[torch.Tensor],
          loss: Callable[[Any], float]) -> probes.ProbeSite:
    """A probe site at θ_t = `blocks` whose update is θ_t − θ_prev (fp32), as a backend's from two versions."""
    def update(b: int) -> torch.Tensor:
        return blocks[b].param.detach().float() - prev[b]

    def no_seeded(seed: int, alpha: float, dist: str) -> float:
        raise ValueError("group-line sites evaluate no seeded direction")

    return probes.ProbeSite(blocks, loss, no_seeded, update)


@torch.no_grad()
def group_line_losses(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                      batches: Sequence[Any], gmap: GroupMap, prev: Sequence[torch.Tensor],
                      alphas: Sequence[float], eps: float = DESIGN_EPS) -> tuple[dict[Role, torch.Tensor], int]:
    """({role: (B, J) float64 losses L_b(θ_t + alphas[j]·d_G)}, forward passes spent) over `batches`, in process:
    `group_line_rounds` evaluated on `model` (θ_t) with θ_prev = `prev` through trainer.zo.probes.probe_losses
    (what every backend runs), then `group_line_table`.

    α = 0 is the clean model, evaluated once per batch; every α must be a multiple of `eps` (design_seeds). Raises
    ValueError when `prev` does not hold one tensor per canonical block (model.parameters(), tied once) of the same
    shape.
    """
    blocks = canonical_blocks(model)
    if len(prev) != len(blocks):
        raise ValueError(f"prev holds {len(prev)} tensors, the model {len(blocks)} canonical blocks")
    fwd = 0
    refresh = []
    for r in group_line_rounds(gmap, batches, 1, 0, alphas, eps, prefix="local"):
        def loss(new, batch=r.batch) -> float:
            nonlocal fwd
            fwd += 1
            return swapped_loss(model, blocks, loss_fn, batch, new)

        site = _site(blocks, prev, loss)
        l0 = loss(None) if r.want_clean else None
        res = []
        for s in r.seeds:
            lp, lm, _ = probes.probe_losses(site, r.kind, s, r.eps, r.distribution, r.blocks, l0, r.slices)
            res.append(SeedResult(round_id=r.round_id, seed=s, version=r.version, l_plus=lp, l_minus=lm, l0=l0))
        refresh.append((r, res))
    return group_line_table(refresh, alphas, eps), fwd
