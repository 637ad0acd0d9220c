"""Probe distributions: which random code an element draws and the value that code maps to.

Both distributions are integer-only after the generator (a bit or a byte indexes a fixed float32 value),
so z is bit-exact on every device.
"""

from __future__ import annotations

import enum
from functools import lru_cache
from statistics import NormalDist

import numpy as np


class ProbeDist(str, enum.Enum):
    """Distribution of the seeded probe direction z.

    - ``rademacher``: one random bit per element, z = +1 if the bit is 0 else -1.
    - ``gauss8``: one random byte v per element, z = GAUSS8_TABLE[v] (unit-variance Gaussian quantiles).
    """

    RADEMACHER = "rademacher"
    GAUSS8 = "gauss8"

    @property
    def elems_per_call(self) -> int:
        """Elements served by one Philox4x32-10 call (128 random bits): 128 for rademacher, 16 for gauss8."""
        return 128 if self is ProbeDist.RADEMACHER else 16


def as_dist(dist: ProbeDist | str) -> ProbeDist:
    """Coerce a str or ProbeDist to ProbeDist; raises ValueError naming the valid choices."""
    try:
        return ProbeDist(dist)
    except ValueError:
        raise ValueError(f"unknown probe distribution {dist!r}; use one of {[d.value for d in ProbeDist]}") from None


def _build_gauss8_table() -> np.ndarray:
    """(256,) float32: Phi^-1((i + 0.5)/256), mirrored to be exactly antisymmetric, scaled to unit second
    moment in float64, then rounded to float32. Ascending in i; no entry is zero."""
    nd = NormalDist()
    half = np.array([nd.inv_cdf((i + 0.5) / 256.0) for i in range(128, 256)], dtype=np.float64)
    q = np.concatenate([-half[::-1], half])
    q /= np.sqrt(np.mean(q * q))
    return q.astype(np.float32)


GAUSS8_TABLE: np.ndarray = _build_gauss8_table()
GAUSS8_TABLE.setflags(write=False)


@lru_cache(maxsize=1)
def gauss8_moments() -> tuple[float, float]:
    """Exact (m2, m4) = (mean of t^2, mean of t^4) of the float32 GAUSS8_TABLE, computed in float64.

    m2 equals 1 up to float32 rounding of the entries; m4 (= KAPPA, about 2.9) is the fourth moment that
    makes per-coordinate curvature identifiable (DESIGN.md section 2). The odd moments are exactly 0.
    """
    t = GAUSS8_TABLE.astype(np.float64)
    return float(np.mean(t**2)), float(np.mean(t**4))


KAPPA: float = gauss8_moments()[1]


def dist_moments(dist: ProbeDist | str) -> tuple[float, float]:
    """(E z^2, E z^4) of one element under `dist`: (1, 1) for rademacher, gauss8_moments() for gauss8."""
    return (1.0, 1.0) if as_dist(dist) is ProbeDist.RADEMACHER else gauss8_moments()
