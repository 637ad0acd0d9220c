"""Pure-PyTorch reference of every kernel: same bits as the Triton kernels, on any device.

Element layout of z (the definition every implementation follows). Element i of the canonical flat
parameter order (i >= 0, int64) draws from Philox call c with key (seed & 0xffffffff, seed >> 32):

- gauss8:     c = i // 16, byte b = i % 16 of the 128 returned bits, where byte b is bits 8*(b % 4) ..
              8*(b % 4) + 7 (least significant first) of output word r_(b // 4); z_i = GAUSS8_TABLE[byte].
- rademacher: c = i // 128, bit j = i % 128 is bit (j % 32) (least significant first) of word r_(j // 32);
              z_i = +1 if the bit is 0, -1 if it is 1.

Output words r0..r3 are those of ``tl.randint4x(seed, c)`` (see probe_kernels.philox). Arithmetic of the apply
ops (fp32, no fused multiply-add, one final rounding to the output dtype):
    perturb: out = to_dtype(fl(w_f32 + fl(alpha_f32 * z)))
    replay:  w <- fl(... fl(fl(w + fl(c_0 * z_0)) + fl(c_1 * z_1)) ...)   (k = 0, 1, ..., K-1 in order)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from probe_kernels.dist import GAUSS8_TABLE, ProbeDist, as_dist
from probe_kernels.philox import check_seed, randint4x

# Counters per generator chunk: bounds the int64 temporaries to ~ 4 * 8 * CHUNK bytes per word array, and how long a
# chunk hook waits (2**15 counters: 512K gauss8 elements, ~50 ms on one CPU thread).
_CHUNK_COUNTERS = 1 << 15
_chunk_hooks: list[Callable[[], None]] = []


def add_chunk_hook(hook: Callable[[], None]) -> Callable[[], None]:
    """Call `hook()` before each chunk of directions this (reference, CPU) path generates and before each
    perturbation of a model plan on any device (probe_kernels.ops.ModelPlan.perturb), in the calling thread; an
    exception it raises ends that work (a serving worker cuts a perturbation, a probe or a replay this way:
    probe_worker.worker). Returns a function that removes it."""
    _chunk_hooks.append(hook)
    return lambda: _chunk_hooks.remove(hook)


def run_chunk_hooks() -> None:
    """Call every hook of `add_chunk_hook` (nothing when none is set)."""
    for hook in _chunk_hooks:
        hook()


_GAUSS_SHIFTS = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
_RADE_SHIFTS = torch.arange(32, dtype=torch.int64)


def check_range(offset: int, numel: int) -> None:
    """Raise TypeError/ValueError unless offset >= 0 and numel >= 0 are ints."""
    for name, v in (("offset", offset), ("numel", numel)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


def direction_codes(seed: int, offset: int, numel: int, dist: ProbeDist | str, device="cpu") -> torch.Tensor:
    """Random codes of elements [offset, offset + numel): (numel,) int64 bytes (gauss8) or bits (rademacher).

    Raises TypeError/ValueError for a bad seed, offset or numel.
    """
    dist = as_dist(dist)
    check_seed(seed)
    check_range(offset, numel)
    epc = dist.elems_per_call
    device = torch.device(device)
    out = torch.empty(numel, dtype=torch.int64, device=device)
    if numel == 0:
        return out
    c_first, c_last = offset // epc, (offset + numel - 1) // epc
    shifts = (_GAUSS_SHIFTS if dist is ProbeDist.GAUSS8 else _RADE_SHIFTS).to(device)
    mask = 0xFF if dist is ProbeDist.GAUSS8 else 1
    for c0 in range(c_first, c_last + 1, _CHUNK_COUNTERS):
        run_chunk_hooks()
        c1 = min(c0 + _CHUNK_COUNTERS, c_last + 1)
        words = randint4x(seed, torch.arange(c0, c1, dtype=torch.int64, device=device))  # (C, 4)
        codes = ((words[:, :, None] >> shifts) & mask).reshape(-1)  # element order: c, word, byte/bit
        lo = max(offset, c0 * epc)
        hi = min(offset + numel, c1 * epc)
        out[lo - offset : hi - offset] = codes[lo - c0 * epc : hi - c0 * epc]
    return out


def direction_ref(seed: int, offset: int, numel: int, dist: ProbeDist | str, device="cpu") -> torch.Tensor:
    """z(seed)[offset : offset + numel] as a (numel,) float32 tensor on `device` (reference path)."""
    dist = as_dist(dist)
    codes = direction_codes(seed, offset, numel, dist, device)
    if dist is ProbeDist.GAUSS8:
        return _table(codes.device)[codes]
    return 1.0 - 2.0 * codes.to(torch.float32)


_tables: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    if device not in _tables:
        _tables[device] = torch.from_numpy(GAUSS8_TABLE.copy()).to(device)
    return _tables[device]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float32)


def perturb_ref(w: torch.Tensor, seed: int, offset: int, alpha: float, dist: ProbeDist | str) -> torch.Tensor:
    """out = w + alpha * z(seed)[offset : offset + w.numel()] with fp32 math and one rounding to w.dtype.

    w: any shape, float32/bfloat16/float16; returns a new tensor of w's shape, dtype and device.
    """
    z = direction_ref(seed, offset, w.numel(), dist, w.device).view(w.shape)
    a = _f32(alpha).to(w.device)
    return (w.to(torch.float32) + a * z).to(w.dtype)


def replay_ref(
    w: torch.Tensor, seeds: list[int], coeffs: list[float], offset: int, dist: ProbeDist | str
) -> torch.Tensor:
    """w + sum_k coeffs[k] * z(seeds[k]) accumulated in fp32 in order k = 0..K-1 (new tensor, w.dtype)."""
    if len(seeds) != len(coeffs):
        raise ValueError(f"seeds and coeffs differ in length: {len(seeds)} vs {len(coeffs)}")
    acc = w.to(torch.float32).clone()
    for s, c in zip(seeds, coeffs):
        z = direction_ref(int(s), offset, w.numel(), dist, w.device).view(w.shape)
        acc = acc + _f32(c).to(w.device) * z
    return acc.to(w.dtype)
