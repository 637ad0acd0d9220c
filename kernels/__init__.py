"""Seeded probe kernels: z(seed, offset) from Philox4x32-10, fused Triton apply kernels, PyTorch references.

See kernels.reference for the exact element layout of z and the arithmetic every implementation follows.
Names are imported lazily so that `kernels.cli` (typer only) does not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GAUSS8_TABLE": "kernels.dist", "KAPPA": "kernels.dist", "ProbeDist": "kernels.dist",
    "dist_moments": "kernels.dist", "gauss8_moments": "kernels.dist",
    "ProbeEvaluator": "kernels.evaluator", "canonical_offsets": "kernels.evaluator",
    "WholeModelEvaluator": "kernels.fastpath", "make_evaluator": "kernels.fastpath",
    "FastForward": "kernels.fastpath", "lm_logits": "kernels.fastpath",
    "ModelPlan": "kernels.ops", "axpy_": "kernels.ops", "direction": "kernels.ops", "perturb": "kernels.ops", "perturb_model": "kernels.ops",
    "replay_": "kernels.ops", "replay_model": "kernels.ops", "seeds_tensor": "kernels.ops",
    "triton_available": "kernels.ops", "uses_triton": "kernels.ops",
}
__all__ = [  # noqa: RUF022 - grouped by module like _EXPORTS
    "GAUSS8_TABLE", "KAPPA", "ProbeDist", "dist_moments", "gauss8_moments", "ProbeEvaluator", "canonical_offsets",
    "WholeModelEvaluator", "make_evaluator", "FastForward", "lm_logits", "ModelPlan", "axpy_", "direction", "perturb", "perturb_model", "replay_", "replay_model", "seeds_tensor",
    "triton_available", "uses_triton",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
