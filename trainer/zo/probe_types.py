"""The probes' basic types: kinds, canonical blocks, block slices, a seed's result and the round checks that need no
kind table (trainer.zo.probes holds the kinds' meaning, `KINDS`, and the trainer's round, `RoundSpec`; it re-exports
these names, the import path callers use).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from probe_kernels import canonical_offsets

BlockSlice = tuple[int, int, int, int]  # (block, dim, start, stop): elements [start, stop) along dim of a block
Slices = Sequence[BlockSlice]


class ProbeFitError(ValueError):
    """A well-formed round that does not fit the model it probes: a block index out of range, a slice outside its
    block's shape, or a block whose shape differs between the two versions of an update. The wire cannot see it
    (the coordinator holds no model); a worker rejects such a task as `invalid` (counted, never retried:
    probe_worker.tasks), the trainer refuses such a round at submit."""


class ProbeKind(str, Enum):
    """How a round's seeds map to perturbation directions (trainer.zo.probes' docstring); values: wire names."""

    SEEDED = "seeded"
    BLOCK_SCALED = "block_scaled"
    ALONG_UPDATE = "along_update"
    GROUP = "group"
    LINE = "line"
    GROUP_LINE = "group_line"
    EVAL = "eval"


@dataclass(frozen=True)
class Block:
    """One canonical parameter block: its name, the live parameter and its global flat offset (elements)."""

    name: str
    param: torch.nn.Parameter
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements n_b of the block."""
        return self.param.numel()


def canonical_blocks(model: torch.nn.Module) -> list[Block]:
    """The model's canonical blocks in order (probe_kernels.canonical_offsets: named_parameters, tied once)."""
    return [Block(n, p, o) for n, p, o in canonical_offsets(model)]


def block_sizes(blocks: Sequence[Block]) -> list[int]:
    """numel of each block, in order."""
    return [b.numel for b in blocks]


@dataclass(frozen=True)
class SeedResult:
    """Scalars of one probe: losses in nats (task loss units), stamped with the version probed.

    `l0` is None unless the round wanted the clean loss; `scale` is ‖u_b‖/√n_b for along_update probes
    (0.0 when the block did not move, in which case l_plus = l_minus = l0 and the probe carries nothing).
    """

    round_id: str
    seed: int
    version: int
    l_plus: float
    l_minus: float
    l0: float | None = None
    scale: float | None = None
    worker: str = "in-process"


def check_group(group: Sequence[int], n_blocks: int | None = None) -> None:
    """Raise ValueError unless `group` is non-empty and strictly increasing; ProbeFitError (a ValueError) when, given
    n_blocks, an index is out of range."""
    if not group:
        raise ValueError("a group or group_line round needs at least one block index")
    if any(b < 0 for b in group) or any(x >= y for x, y in itertools.pairwise(group)):
        raise ValueError(f"group block indices must be sorted, distinct and >= 0, got {list(group)[:16]}")
    if n_blocks is not None and group[-1] >= n_blocks:
        raise ProbeFitError(f"group block index {group[-1]} out of range [0, {n_blocks})")


def check_fits(blocks: Sequence[Block], group: Sequence[int], slices: Slices = ()) -> None:
    """Raise ProbeFitError unless every index of `group` names one of `blocks` and every slice (block, dim, start,
    stop) lies within its block's shape (ValueError for a group or slices malformed in themselves)."""
    check_group(group, len(blocks))
    check_slices(slices, group)
    for b, dim, start, stop in slices:
        shape = tuple(blocks[b].param.shape)
        if not (dim < len(shape) and stop <= shape[dim]):
            raise ProbeFitError(f"slice ({b}, {dim}, {start}, {stop}) outside block {b} of shape {shape}")


def check_slices(slices: Slices, group: Sequence[int]) -> None:
    """Raise ValueError unless every slice (block, dim, start, stop) names a distinct block of `group`, with
    dim >= 0 and 0 <= start < stop."""
    named = [s[0] for s in slices]
    if len(set(named)) != len(named) or not set(named) <= set(group):
        raise ValueError(f"slices must name distinct blocks of the round's group, got {named[:16]}")
    if any(len(s) != 4 or s[1] < 0 or not 0 <= s[2] < s[3] for s in slices):
        raise ValueError("a slice is (block, dim >= 0, start >= 0, stop > start)")
