"""Perturbed weights of the non-seeded probe kinds, computed exactly as trainer.zo.backend does in process.

Kinds (DESIGN.md section 2, trainer.zo.backend.ProbeKind):
- ``block_scaled``: z = sum_b a_b r_b with a = estimators.block_scales(seed) (gauss8, one per canonical
  block) and r the Rademacher stream of estimators.block_sign_seed(seed) at each element's global offset;
  block b becomes kernels.perturb(w_b, sign_seed, offset_b, alpha * a_b, "rademacher").
- ``along_update``: the seed is a block index b; u_b = theta_v[b] - theta_base[b] in fp32, scale =
  ||u_b|| / sqrt(n_b) (norm in float64), and block b becomes (w_b + alpha * u_b / scale) rounded once to
  its dtype. A block that did not move (scale 0) gives L+ = L- = L0.

Perturbed blocks are swapped in (``param.data = new``) for one forward pass and swapped back; the
clean storages are never written. The arithmetic mirrors InProcessBackend line for line, which is what
makes fleet results bit-identical to in-process ones.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernels import perturb


def blocks(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, int]]:
    """(parameter, global offset) of each canonical block (`named_parameters()` order, ties once)."""
    out, offset = [], 0
    for _, p in model.named_parameters():
        out.append((p, offset))
        offset += p.numel()
    return out


@contextlib.contextmanager
def swapped(params: list[tuple[torch.nn.Parameter, int]], new: dict[int, torch.Tensor]) -> Iterator[None]:
    """Point block i's `.data` at new[i] for the duration; restore the original storages afterwards."""
    saved = {i: params[i][0].data for i in new}
    try:
        for i, t in new.items():
            params[i][0].data = t
        yield
    finally:
        for i, t in saved.items():
            params[i][0].data = t


def block_scaled_weights(params: list[tuple[torch.nn.Parameter, int]], seed: int,
                         alpha: float) -> dict[int, torch.Tensor]:
    """Every block of theta + alpha * z_block_scaled(seed), out of place, each in its parameter's dtype."""
    from trainer.zo import estimators as est

    a = est.block_scales(seed, len(params))
    rs = est.block_sign_seed(seed)
    return {i: perturb(p.detach(), rs, off, alpha * float(a[i]), "rademacher") for i, (p, off) in enumerate(params)}


def along_update(params_v: list[tuple[torch.nn.Parameter, int]], params_base: list[tuple[torch.nn.Parameter, int]],
                 b: int, eps: float, loss: Callable[[dict[int, torch.Tensor] | None], float],
                 l0: float | None) -> tuple[float, float, float]:
    """(L+, L-, scale) of the along-update probe of block `b` between two loaded versions.

    `loss(new)` evaluates the model of `params_v` with blocks `new` swapped in (None: clean).
    Raises ValueError if `b` is not a block index or the versions' block shapes differ.
    """
    if not 0 <= b < len(params_v) or len(params_v) != len(params_base):
        raise ValueError(f"block index {b} out of range [0, {len(params_v)}) or versions differ in blocks")
    w, w_base = params_v[b][0].detach(), params_base[b][0].detach()
    if w.shape != w_base.shape:
        raise ValueError(f"block {b} has shape {tuple(w.shape)} in one version, {tuple(w_base.shape)} in the other")
    u = w.float() - w_base.float()
    norm = float(torch.linalg.vector_norm(u.double()))
    scale = norm / math.sqrt(w.numel())
    if norm == 0.0:
        base = l0 if l0 is not None else loss(None)
        return base, base, 0.0
    uhat = u / scale
    lp = loss({b: (w.float() + eps * uhat).to(w.dtype)})
    lm = loss({b: (w.float() - eps * uhat).to(w.dtype)})
    return lp, lm, scale


@torch.no_grad()
def swapped_loss(model: torch.nn.Module, params: list[tuple[torch.nn.Parameter, int]],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any,
                 new: dict[int, torch.Tensor] | None) -> float:
    """loss_fn(model, batch) as a float with blocks `new` swapped in (None: the clean model)."""
    with swapped(params, new or {}):
        return float(loss_fn(model, batch))
