"""Save/load the canonical parameters as safetensors, each tensor once, under its canonical name.

safetensors refuses tensors that share storage (GPT-2's tied wte/lm_head), so we store exactly the
canonical parameters (`named_parameters()`, tied weights once). Loading copies into the existing
parameters, so ties survive. Buffers are not stored: every buffer of the supported models is either
non-persistent or derived from the config (rotary frequencies, position ids).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.models.params import canonical_parameters, param_order_hash

FORMAT = "sparecycles-params-v1"


def save_safetensors_model(
    model: torch.nn.Module,
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the canonical parameters of `model` to a safetensors file (atomically: tmp + rename).

    The header metadata holds `format`, `param_order_hash` and the caller's string `metadata`.
    Tensors are saved from CPU copies in their own dtype, or cast to `dtype` (e.g. torch.bfloat16
    to publish probe weights at half the bytes; one round-to-nearest-even per element).

    Returns:
        The written path. Raises TypeError for non-string metadata values (safetensors' rule) or a
        non-floating dtype.
    """
    path = Path(path)
    meta = {"format": FORMAT, "param_order_hash": param_order_hash(model)}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
        meta[k] = v
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    tensors = {
        name: p.detach().to(device="cpu", dtype=dtype or p.dtype).contiguous()
        for name, p in canonical_parameters(model)
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Return the string metadata of a safetensors file header (empty dict if none)."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


@torch.no_grad()
def load_safetensors_into(model: torch.nn.Module, path: str | os.PathLike, *, strict_dtype: bool = True) -> dict[str, str]:
    """Load a file written by `save_safetensors_model` into `model`'s parameters, in place.

    Args:
        strict_dtype: if True, every stored dtype must equal the parameter's (bit-exact restore);
            if False, values are cast (e.g. fp32 file into a bf16 probe copy).

    Returns:
        The file's metadata.

    Raises:
        FileNotFoundError: no file. ValueError: parameter names/shapes (or, with strict_dtype,
        dtypes) differ from the model's, naming the first differences.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors file at {path}")
    params = dict(canonical_parameters(model))
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        keys = set(f.keys())
        missing, extra = sorted(set(params) - keys), sorted(keys - set(params))
        if missing or extra:
            raise ValueError(
                f"{path} does not match the model: missing {missing[:5]} ({len(missing)}), "
                f"unexpected {extra[:5]} ({len(extra)}); was it saved from a different preset?"
            )
        for name, p in params.items():
            shape = list(f.get_slice(name).get_shape())
            if shape != list(p.shape):
                raise ValueError(f"{path}: {name} has shape {shape}, the model expects {list(p.shape)}")
            t = f.get_tensor(name)
            if strict_dtype and t.dtype != p.dtype:
                raise ValueError(
                    f"{path}: {name} is {t.dtype}, the model is {p.dtype}; pass strict_dtype=False to cast"
                )
            p.copy_(t)
    return meta
