"""AdamW with per-role and global lr multipliers, and the in-process probes that set them (ZO-Curv (d), (e)).

`RoleAdamW` is torch.optim.AdamW (decoupled weight decay, bias-corrected moments; Loshchilov & Hutter
2019) where parameter block b runs at lr·g·s_b: s_b a float or a tensor broadcast over the block (GPT-2's
fused c_attn carries QK and V columns, trainer.zo.groups), g a global multiplier. The multiplier scales the
whole per-element lr, weight decay included, exactly as separate AdamW parameter groups with those lrs
would (Wang et al. 2025 put each block type in its own group).

The probes evaluate losses on swapped-in out-of-place weights (the model's storages are never written):
- `group_curvatures`: per role G, K Rademacher probes restricted to G at step ε_G = ε_rel·RMS(θ_G) on one
  batch with one clean pass L0 (common random numbers): h_k = (L+ + L− − 2·L0)/ε_G², E h = tr(H_GG);
- `line_losses`: L(θ_t + α·d) at the given α for d = θ_t − θ_{t−k} (α = 0 is the clean pass).
Seeds: derive_seed(seed, TAG, refresh, role index, k); z(seed) at each element's global canonical offset
(kernels.perturb, as every probe kind in trainer.zo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from kernels import canonical_offsets, perturb
from trainer.zo import estimators as est
from trainer.zo.groups import GroupMap, Role
from trainer.zo.multipliers import CurvEstimate, group_curvature

TAG_GROUP = 0x6A0C  # seed stream of the group probes


class RoleAdamW(torch.optim.Optimizer):
    """AdamW whose block b steps with lr·global_mult·block_mult[b] (module docstring). fp32 params only.

    θ ← θ·(1 − lr_b·wd);  θ ← θ − lr_b·m̂/(√v̂ + eps),  lr_b = lr·g·s_b  (torch.optim.AdamW's op order).

    Args: params/lr/betas/eps/weight_decay as torch.optim.AdamW; blocks: the canonical parameter list
    (list(model.parameters()) order) the multipliers index. Raises ValueError when `blocks` is not exactly
    the optimised parameters, TypeError for a non-fp32 parameter.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 *, blocks: Sequence[torch.Tensor]) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        flat = [p for g in self.param_groups for p in g["params"]]
        if {id(p) for p in blocks} != {id(p) for p in flat} or len(blocks) != len(flat):
            raise ValueError("`blocks` must list exactly the optimised parameters, once each, in canonical order")
        if any(p.dtype != torch.float32 for p in flat):
            raise TypeError("RoleAdamW keeps no fp32 masters: train fp32 weights")
        self.block_index = {id(p): i for i, p in enumerate(blocks)}
        self.block_mult: list[float | torch.Tensor] = [1.0] * len(blocks)
        self.global_mult = 1.0
        self.last_clipped_frac = 0.0  # logged by the modes beside the other ZO-Curv optimizers

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step with the current multipliers (formula in the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                t = float(st["step"])
                s = self.block_mult[self.block_index[id(p)]]
                lr = g["lr"] * self.global_mult
                grad = p.grad
                if isinstance(s, torch.Tensor):
                    p.mul_(1 - lr * g["weight_decay"] * s)
                else:
                    p.mul_(1 - lr * s * g["weight_decay"])
                st["exp_avg"].lerp_(grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / (1 - b2**t) ** 0.5).add_(g["eps"])
                if isinstance(s, torch.Tensor):
                    p.addcdiv_(st["exp_avg"] * s, denom, value=-lr / (1 - b1**t))
                else:
                    p.addcdiv_(st["exp_avg"], denom, value=-lr * s / (1 - b1**t))
        return loss


@contextlib.contextmanager
def swapped(params: Sequence[torch.Tensor], new: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Point params[i].data at new[i] for the duration; restore the original storages afterwards."""
    saved = {i: params[i].data for i in new}
    try:
        for i, t in new.items():
            params[i].data = t
        yield
    finally:
        for i, t in saved.items():
            params[i].data = t


def group_rms(params: Sequence[torch.Tensor], gmap: GroupMap, role: Role) -> float:
    """RMS of θ over the elements of `role` (segments honoured), float."""
    sq, n = 0.0, 0
    for seg in gmap.groups[role]:
        w = params[seg.block].detach().double()
        m = seg.mask(w.device)
        sq += float((w * w).sum() if m is None else (w * w)[m].sum())
        n += seg.numel
    return (sq / max(n, 1)) ** 0.5


def group_perturbed(params: Sequence[torch.Tensor], offsets: Sequence[int], gmap: GroupMap, role: Role, seed: int,
                    alpha: float) -> dict[int, torch.Tensor]:
    """Out-of-place weights θ + α·z_G: Rademacher z(seed) at global offsets, zero outside `role`'s segments.

    On whole-block segments this is exactly the ``group`` probe kind (trainer.zo.probes.group_weights with
    dist "rademacher" and ε = α), so a role made of whole blocks (every Llama role) is a group round any
    backend can evaluate; segments of a block (GPT-2's c_attn QK | V columns) keep the rest of it clean.
    """
    out: dict[int, torch.Tensor] = {}
    for seg in gmap.groups[role]:
        w = params[seg.block].detach()
        base = out.get(seg.block, w)
        moved = perturb(w, seed, offsets[seg.block], alpha, "rademacher")
        m = seg.mask(w.device)
        out[seg.block] = moved if m is None else torch.where(m, moved, base)
    return out


@torch.no_grad()
def group_curvatures(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                     gmap: GroupMap, *, probes: int, eps_rel: float, seed: int, refresh: int
                     ) -> tuple[dict[Role, CurvEstimate], dict[str, float], int]:
    """Per-role curvature from `probes` group-restricted probes each on one batch (module docstring).

    Returns ({role: CurvEstimate}, extra stats {"l0", "eps_<role>"}, forward passes spent = 1 + 2·probes·roles).
    Raises ValueError for probes < 1 or eps_rel <= 0.
    """
    if probes < 1 or not eps_rel > 0:
        raise ValueError(f"need probes >= 1 and eps_rel > 0, got {probes}, {eps_rel}")
    params = list(model.parameters())
    offsets = [o for _, _, o in canonical_offsets(model)]
    l0 = float(loss_fn(model, batch))
    fwd, stats, out = 1, {"l0": l0}, {}
    for ri, role in enumerate(gmap.roles):
        eps = eps_rel * max(group_rms(params, gmap, role), 1e-8)
        hs = []
        for k in range(probes):
            s = est.derive_seed(seed, TAG_GROUP, refresh, ri, k)
            with swapped(params, group_perturbed(params, offsets, gmap, role, s, eps)):
                lp = float(loss_fn(model, batch))
            with swapped(params, group_perturbed(params, offsets, gmap, role, s, -eps)):
                lm = float(loss_fn(model, batch))
            hs.append((lp + lm - 2 * l0) / eps**2)
            fwd += 2
        out[role] = group_curvature(hs, gmap.size(role))
        stats[f"eps_{role.value}"] = eps
    return out, stats, fwd


@torch.no_grad()
def line_losses(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                prev: Sequence[torch.Tensor], alphas: Sequence[float]) -> list[float]:
    """L(θ_t + α·(θ_t − θ_prev)) for each α on one batch; prev: fp32 copies of the canonical blocks at θ_{t−k}.

    α = 0 evaluates the clean weights. Raises ValueError when prev does not match the model's blocks.
    """
    params = list(model.parameters())
    if len(prev) != len(params) or any(a.shape != b.shape for a, b in zip(prev, params)):
        raise ValueError("prev must hold one tensor per canonical block, same shapes")
    out = []
    for a in alphas:
        if a == 0:
            out.append(float(loss_fn(model, batch)))
            continue
        new = {i: (p.detach().float() + a * (p.detach().float() - q)).to(p.dtype) for i, (p, q) in
               enumerate(zip(params, prev))}
        with swapped(params, new):
            out.append(float(loss_fn(model, batch)))
    return out
