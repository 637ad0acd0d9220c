"""Group-line probes: losses along one role's share of the displacement since the last refresh.

For role G (trainer.zo.groups: segments of canonical blocks) and d = θ_t − θ_prev, the probe at α moves only
G's elements: block b becomes w_b + α·d_b on G's segments of b (fp32 math, rounded once to the block's dtype)
and stays w_b elsewhere (GPT-2's c_attn: the QK columns move, the V columns do not, or the reverse). The
weights are built out of place and swapped in for one forward pass; the model's storages are never written
(trainer.zo.probes.swapped_loss). This is the evaluation the calibrated trust region (trainer.zo.trust_region)
fits; it runs in process (a fleet probe kind carrying segments is not built yet: trainer.zo.probes' ``group``
kind moves whole blocks along a seeded z, ``line`` every block along d).

Cost per refresh: B·(1 + R·(J − 1)) forward passes for B batches, R roles and J designed points (α = 0 once
per batch, shared by every role).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.zo.groups import GroupMap, Role
from trainer.zo.probes import canonical_blocks, swapped_loss


def group_line_weights(params: Sequence[torch.Tensor], prev: Sequence[torch.Tensor], gmap: GroupMap, role: Role,
                       alpha: float) -> dict[int, torch.Tensor]:
    """{block index: weights} of θ_t + α·(θ_t − θ_prev) restricted to `role`'s segments, out of place.

    params: canonical blocks at θ_t (any dtype); prev: fp32 tensors of the same shapes at θ_prev.
    Raises ValueError for a shape mismatch.
    """
    out: dict[int, torch.Tensor] = {}
    for seg in gmap.groups[role]:
        w = params[seg.block].detach()
        q = prev[seg.block]
        if q.shape != w.shape:
            raise ValueError(f"block {seg.block} ({seg.name}) has shape {tuple(w.shape)} at θ_t, {tuple(q.shape)} at θ_prev")
        moved = (w.float() + alpha * (w.float() - q)).to(w.dtype)
        m = seg.mask(w.device)
        out[seg.block] = moved if m is None else torch.where(m, moved, out.get(seg.block, w))
    return out


@torch.no_grad()
def group_line_losses(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                      batches: Sequence[Any], gmap: GroupMap, prev: Sequence[torch.Tensor],
                      alphas: Sequence[float]) -> tuple[dict[Role, torch.Tensor], int]:
    """({role: (B, J) float64 losses L_b(θ_t + alphas[j]·d_G)}, forward passes spent) over `batches`.

    α = 0 is the clean model, evaluated once per batch. Raises ValueError when `prev` does not hold one
    tensor per canonical block (model.parameters(), tied once) of the same shape.
    """
    params = list(model.parameters())
    blocks = canonical_blocks(model)
    if len(prev) != len(params):
        raise ValueError(f"prev holds {len(prev)} tensors, the model {len(params)} canonical blocks")
    out = {r: torch.empty(len(batches), len(alphas), dtype=torch.float64) for r in gmap.roles}
    fwd = 0
    for b, batch in enumerate(batches):
        l0 = float(loss_fn(model, batch))
        fwd += 1
        for role in gmap.roles:
            for j, a in enumerate(alphas):
                if a == 0:
                    out[role][b, j] = l0
                    continue
                out[role][b, j] = swapped_loss(model, blocks, loss_fn, batch,
                                               group_line_weights(params, prev, gmap, role, a))
                fwd += 1
    return out, fwd
