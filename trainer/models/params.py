"""Canonical parameter order: the one flat indexing of theta that every component shares.

theta's canonical order is `model.named_parameters()` order, which lists a tied weight once (under
its first name, e.g. GPT-2's `transformer.wte.weight`, not `lm_head.weight`). Offset i of the flat
vector is the i-th element of that concatenation of row-major flattened tensors. Seeded directions
z(seed)[offset:offset+numel] (probe_kernels.direction) are indexed by these offsets.
"""

from __future__ import annotations

import hashlib
import json

import torch

from probe_kernels import canonical_offsets


def canonical_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Return `list(model.named_parameters())`: (name, parameter) pairs, tied weights once."""
    return list(model.named_parameters())


def param_offsets(model: torch.nn.Module) -> list[int]:
    """Global flat offset (elements, not bytes) of each canonical parameter; offsets[0] == 0.

    offsets[k + 1] - offsets[k] == numel of parameter k.
    """
    return [o for _, _, o in canonical_offsets(model)]


def num_params(model: torch.nn.Module) -> int:
    """d = total number of elements of the canonical parameters (tied weights counted once)."""
    return sum(p.numel() for _, p in canonical_parameters(model))


def param_order_hash(model: torch.nn.Module) -> str:
    """Hex sha256 of the canonical order: a JSON list of [name, shape] pairs, in order.

    Deliberately dtype- and device-independent: a bf16 probe copy on a GPU and the fp32 CPU master
    of the same architecture hash equal, so seeds/offsets computed on one apply to the other.
    Architecture changes (a renamed, added, removed, reordered or reshaped tensor) change the hash.
    """
    desc = [[name, list(p.shape)] for name, p in canonical_parameters(model)]
    return hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()


def flatten_params(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate the canonical parameters into a new flat tensor theta (d,).

    Args:
        dtype: result dtype; None keeps the parameters' dtype (which must then be uniform).

    Returns:
        (d,) tensor on the parameters' device, detached (a copy; editing it changes nothing).

    Raises:
        ValueError: mixed parameter dtypes or devices with dtype=None / on several devices, or no parameters.
    """
    params = [p for _, p in canonical_parameters(model)]
    if not params:
        raise ValueError("model has no parameters to flatten")
    dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; move the model first")
    if dtype is None and len(dtypes) > 1:
        raise ValueError(f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass dtype=")
    return torch.cat([p.detach().reshape(-1).to(dtype or params[0].dtype) for p in params])


@torch.no_grad()
def unflatten_into_(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat theta (d,) back into the canonical parameters, in place.

    Values are cast to each parameter's dtype/device (exact when dtypes match). Tied weights receive
    their single slice, so ties stay intact.

    Raises:
        TypeError: `flat` is not a tensor. ValueError: `flat` is not 1-D of length num_params(model).
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a torch.Tensor (d,), got {type(flat).__name__}")
    d = num_params(model)
    if flat.dim() != 1 or flat.numel() != d:
        raise ValueError(f"flat must have shape ({d},) for this model, got {tuple(flat.shape)}")
    offset = 0
    for _, p in canonical_parameters(model):
        n = p.numel()
        p.copy_(flat[offset : offset + n].view(p.shape))
        offset += n
