"""Philox4x32-10 in pure PyTorch, bit-identical to Triton's ``tl.randint4x``.

Source: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11) and Random123; the round and
key-schedule constants and the word order are those of ``triton/language/random.py`` (``philox_impl``):

    c0' = mulhi(B, c2) ^ c1 ^ k0      c1' = lo(B * c2)
    c2' = mulhi(A, c0) ^ c3 ^ k1      c3' = lo(A * c0)
    k0 += KEY_A;  k1 += KEY_B         (10 rounds)

``tl.randint4x(seed, offset)`` calls it with counter (c0, c1, c2, c3) = (offset & 0xffffffff, offset >> 32,
0, 0) and key (k0, k1) = (seed & 0xffffffff, seed >> 32) for a 64-bit seed. Arithmetic here is int64 masked
to 32 bits; products are split into 16-bit halves so nothing overflows int64.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
N_ROUNDS = 10
SEED_LIMIT = 1 << 64


def check_seed(seed: int) -> int:
    """Return `seed` if it is an int in [0, 2**64); raise TypeError/ValueError otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be a Python int in [0, 2**64), got {type(seed).__name__}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product a * b; a a 32-bit constant, b int64 in [0, 2**32)."""
    p_lo = a * (b & 0xFFFF)  # < 2**48
    p_hi = a * (b >> 16)  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32
    return hi, lo


def philox4x32_10(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on counters (N,) int64 each in [0, 2**32) with key words k0, k1 in [0, 2**32).

    Returns four (N,) int64 tensors in [0, 2**32): the output words r0..r3 (Random123 order, which is
    also the order of the four values ``tl.randint4x`` returns).
    """
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


def randint4x(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Reference for ``tl.randint4x(seed, counters)``: (N,) int64 counters >= 0 -> (N, 4) int64 words.

    Column w of the result is Triton's w-th return value, reinterpreted as unsigned 32-bit.
    """
    check_seed(seed)
    if counters.dtype != torch.int64:
        raise TypeError(f"counters must be int64, got {counters.dtype}")
    zero = torch.zeros_like(counters)
    r = philox4x32_10(counters & MASK32, counters >> 32, zero, zero, seed & MASK32, seed >> 32)
    return torch.stack(r, dim=1)
