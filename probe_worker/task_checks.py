"""What a worker checks of a probe task before evaluating it: its Celery kwargs parse as a `ProbeTask`
(`parse_task`), and the digest of the run's canary direction it attests once per run (`canary_digest`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from probe_kernels import direction
from wire.round_messages import ProbeTask


def canary_digest(seed: int, numel: int, distribution: str) -> str:
    """sha256 hex of z(seed)[0:numel] as little-endian float32 bytes (the run's canary, DESIGN.md §3).

    z comes from `probe_kernels.direction` on the CPU (bit-identical on every device by construction).
    """
    z = direction(seed, 0, numel, distribution, device="cpu").to(torch.float32).contiguous()
    return hashlib.sha256(z.numpy().astype("<f4", copy=False).tobytes()).hexdigest()


def parse_task(kwargs: Any) -> ProbeTask:
    """Validate Celery task kwargs (a JSON object) as a `ProbeTask`.

    Validated through JSON so integers stay integers and no Python-side coercion happens.
    Raises TypeError for a non-dict, pydantic.ValidationError (a ValueError) on anything malformed.
    """
    if not isinstance(kwargs, dict):
        raise TypeError(f"probe task kwargs must be a JSON object, got {type(kwargs).__name__}")
    return ProbeTask.model_validate_json(json.dumps(kwargs, allow_nan=False))
