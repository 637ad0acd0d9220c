"""Language-model batches from a flat token array: random training windows and fixed eval windows."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

# Philox's 256-bit counter advances by one per 4 x 64-bit block, so counters `index` and `index + 1`
# would give the same stream shifted by one block. Putting the batch index in the top 128 bits keeps
# every index's stream disjoint (2**128 blocks apart).
_INDEX_SHIFT = 128


def _check_tokens(tokens: np.ndarray, seq_len: int, batch_size: int) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise TypeError(f"tokens must be a 1-D numpy array (N,), got {type(tokens).__name__} "
                        f"with shape {getattr(tokens, 'shape', None)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if tokens.shape[0] < seq_len + 1:
        raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.shape[0]}; "
                         "lower seq_len or use a larger split")


def batch_rng(seed: int, index: int) -> np.random.Generator:
    """The counter-based generator for batch `index` of run `seed`: Philox4x64-10 keyed by `seed`.

    Pure in (seed, index): no global state. seed in [0, 2**128), index in [0, 2**128).

    Raises:
        ValueError: seed or index out of range or not an int.
    """
    for label, v, hi in (("seed", seed, 2**128), ("index", index, 2**128)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < hi:
            raise ValueError(f"{label} must be an int in [0, 2**128), got {v!r}")
    return np.random.Generator(np.random.Philox(key=int(seed), counter=int(index) << _INDEX_SHIFT))


def window_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, index: int) -> np.ndarray:
    """Start offsets (B,) int64 of the windows of batch (seed, index), uniform in [0, N - T - 1]."""
    return batch_rng(seed, index).integers(0, n_tokens - seq_len, size=batch_size, dtype=np.int64)


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
              index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows: x = tokens[s : s+T], y = tokens[s+1 : s+T+1] for B random starts s.

    Args:
        tokens: (N,) integer token ids (e.g. a uint16 memmap), N >= T + 1.
        batch_size: B.
        seq_len: T.
        seed, index: the starts are drawn from `batch_rng(seed, index)`, so the batch is a pure function
            of (tokens, B, T, seed, index) — resumable and identical on every machine.

    Returns:
        (x, y): torch.int64 tensors of shape (B, T) on the CPU, with y[:, :-1] == x[:, 1:].

    Raises:
        TypeError: tokens is not a 1-D integer numpy array.
        ValueError: bad sizes, too few tokens, or seed/index out of range.
    """
    _check_tokens(tokens, seq_len, batch_size)
    starts = window_starts(tokens.shape[0], batch_size, seq_len, seed, index)
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (B, T + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def iter_eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                      max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, deterministic set of non-overlapping windows for validation.

    The split holds W = (N - 1) // T disjoint windows (window k covers x = tokens[kT : (k+1)T],
    y shifted by one). We use M = min(W, max_batches * B) of them, evenly spaced over the split
    (window k_j = floor(j * W / M)), so a capped evaluation still samples the whole split. Batches
    have B rows except possibly the last one.

    Yields:
        (x, y): torch.int64 tensors of shape (b, T), b <= B, with y[:, :-1] == x[:, 1:].

    Raises:
        TypeError / ValueError: as `get_batch`; max_batches < 1.
    """
    _check_tokens(tokens, seq_len, batch_size)
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
    n_windows = (tokens.shape[0] - 1) // seq_len
    m = n_windows if max_batches is None else min(n_windows, max_batches * batch_size)
    chosen = (np.arange(m, dtype=np.int64) * n_windows) // m
    offsets = np.arange(seq_len + 1, dtype=np.int64)[None, :]
    for lo in range(0, m, batch_size):
        idx = chosen[lo:lo + batch_size, None] * seq_len + offsets
        windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
