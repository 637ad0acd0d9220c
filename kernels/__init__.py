"""Seeded probe kernels: z(seed, offset) from Philox4x32-10, fused Triton apply kernels, PyTorch references.

See kernels.reference for the exact element layout of z and the arithmetic every implementation follows.
"""

from kernels.dist import GAUSS8_TABLE, KAPPA, ProbeDist, dist_moments, gauss8_moments
from kernels.evaluator import ProbeEvaluator, canonical_offsets
from kernels.ops import (
    axpy_,
    direction,
    perturb,
    perturb_model,
    replay_,
    replay_model,
    seeds_tensor,
    triton_available,
    uses_triton,
)

__all__ = [
    "GAUSS8_TABLE", "KAPPA", "ProbeDist", "ProbeEvaluator", "axpy_", "canonical_offsets", "direction",
    "dist_moments", "gauss8_moments", "perturb", "perturb_model", "replay_", "replay_model", "seeds_tensor",
    "triton_available", "uses_triton",
]
