"""Seeded probe kernels: z(seed, offset) from Philox4x32-10, fused Triton apply kernels, PyTorch references.

See probe_kernels.reference for the exact element layout of z and the arithmetic every implementation follows.
Names are imported lazily so that the CLI (`sparecycles bench kernels`: benchmarks.cli) does not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GAUSS8_TABLE": "probe_kernels.dist", "KAPPA": "probe_kernels.dist", "ProbeDist": "probe_kernels.dist",
    "dist_moments": "probe_kernels.dist", "gauss8_moments": "probe_kernels.dist",
    "ProbeEvaluator": "probe_kernels.evaluator", "canonical_offsets": "probe_kernels.evaluator",
    "WholeModelEvaluator": "probe_kernels.fastpath", "make_evaluator": "probe_kernels.fastpath",
    "FastForward": "probe_kernels.compiled_forward", "lm_logits": "probe_kernels.compiled_forward",
    "ModelPlan": "probe_kernels.ops", "axpy_": "probe_kernels.ops", "direction": "probe_kernels.ops", "perturb": "probe_kernels.ops", "perturb_model": "probe_kernels.ops",
    "replay_": "probe_kernels.ops", "replay_model": "probe_kernels.ops", "seeds_tensor": "probe_kernels.ops",
    "triton_available": "probe_kernels.ops", "uses_triton": "probe_kernels.ops",
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
    raise AttributeError(f"module 'probe_kernels' has no attribute {name!r}")
