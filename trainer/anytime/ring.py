"""The last k published versions, and the small message that names a candidate built from them.

A `CandidateSpec` (versions, coefficients) is all a worker needs to build θ(c) from versions it holds; a
`VersionRing` holds those versions (the trainer's copy, or a worker's) and builds the mixture through
`trainer.anytime.candidates.mix_state`, one fixed summation order, so the same spec gives the same tensors
bit for bit wherever it is built.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.anytime.candidates import SUM_TOL, mix_state


class CandidateSpec(BaseModel):
    """Candidate weights θ(c) = Σ_i coefs[i] · θ_{versions[i]} (versions ascending, Σ coefs = 1).

    Wire schema 1; strict: unknown fields, non-finite or mismatched values are refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    schema_version: Literal[1] = 1
    name: str = Field(min_length=1, max_length=64)
    versions: tuple[int, ...] = Field(min_length=1, max_length=64)
    coefs: tuple[float, ...] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> CandidateSpec:
        if len(self.versions) != len(self.coefs):
            raise ValueError(f"{len(self.versions)} versions but {len(self.coefs)} coefficients")
        if any(v < 0 for v in self.versions) or list(self.versions) != sorted(set(self.versions)):
            raise ValueError(f"versions must be distinct, >= 0 and ascending, got {self.versions}")
        if abs(math.fsum(self.coefs) - 1.0) > SUM_TOL:
            raise ValueError(f"coefficients must sum to 1, got {math.fsum(self.coefs)!r}")
        return self


def build_mixture(terms: Sequence[tuple[int, float]],
                  state_of: Callable[[int], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """θ = Σ c · θ_v over `terms` [(version, coefficient)], the states fetched by `state_of(version)` (a ring, or a
    worker's weight cache), summed in ascending version order by `mix_state` — the one order every process uses,
    so the result does not depend on the order the terms arrive in.

    Raises:
        ValueError: no terms, repeated versions, or coefficients not summing to 1 (mix_state).
        whatever `state_of` raises for a version it cannot supply (KeyError from a VersionRing).
    """
    ordered = sorted(terms)
    if not ordered or len({v for v, _ in ordered}) != len(ordered):
        raise ValueError(f"need distinct versions, got {[v for v, _ in terms]}")
    return mix_state([state_of(v) for v, _ in ordered], [c for _, c in ordered])


class VersionRing:
    """The newest `k` published versions' weights (state dicts of detached copies), oldest first.

    Publishing a version older than or equal to the newest held raises ValueError (versions only grow);
    the oldest is dropped once k are held. Memory: k copies of the floating-point weights.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Keep a copy of `state` as `version` (tensors cloned, so later in-place updates do not leak in)."""
        if self._states and version <= next(reversed(self._states)):
            raise ValueError(f"version {version} is not newer than {next(reversed(self._states))}")
        self._states[version] = {n: t.detach().clone() for n, t in state.items()}
        while len(self._states) > self.k:
            self._states.popitem(last=False)

    def clear(self) -> None:
        """Forget every version (after the trainer's weights jump, e.g. a pull)."""
        self._states.clear()

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions held, ascending."""
        return tuple(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """The weights kept as `version` (not copied: do not modify). Raises KeyError when it is not held."""
        return self._states[version]

    def spec(self, name: str, coefs: tuple[float, ...] | list[float]) -> CandidateSpec:
        """The spec of `coefs` over the versions held (oldest first). Raises ValueError on a length mismatch."""
        return CandidateSpec(name=name, versions=self.versions, coefs=tuple(float(c) for c in coefs))

    def build(self, spec: CandidateSpec) -> dict[str, torch.Tensor]:
        """θ(c) of `spec` (trainer.anytime.candidates.mix_state).

        Raises:
            KeyError: a version of the spec is not held here (the caller should refresh its ring).
        """
        missing = [v for v in spec.versions if v not in self._states]
        if missing:
            raise KeyError(f"versions {missing} are not held (held: {self.versions})")
        return build_mixture(list(zip(spec.versions, spec.coefs, strict=True)), self._states.__getitem__)
