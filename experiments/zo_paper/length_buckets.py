"""Length-bucketed forwards of a right-padded classifier batch (issue 18's speed lever).

A batch of 512 prompts padded to its longest row spends most of its tokens on pads: on the 1,000 training
sentences of `python -m experiments.zo --regime paper` (SmolLM2 prompts) the mean prompt is 30.6 tokens, the longest 66, and a
with-replacement batch of 512 almost always holds a 60+ token row. The prompt classifier
(trainer.prompt_classifier.PromptClassifier) reads each row's logits at its own last real token, right-padded
and causal, so a row's logits do not depend on how far it is padded: a batch can run as a few forwards of
rows of similar length, each trimmed to its own longest row, with the same per-row logits.

`length_buckets` sorts the rows by length (stable) and splits the sorted order into at most `max_chunks`
contiguous chunks of at least `min_rows` rows (the sizes where GPU kernels stay efficient), choosing the
split that minimises the padded token count Σ_chunk rows × max length (an exact dynamic program over the
sorted lengths, O(max_chunks · N²) in vectorised torch; ties go to fewer chunks, then the earliest split:
deterministic). `bucket_batch` applies it to one (ids, mask, labels) batch; `bucketed_ce` is the batch's
mean cross-entropy Σ_rows CE / N and its number of correct rows, exactly the unbucketed batch's quantities
(up to floating summation order).

Measured on the real training split (SmolLM2 tokenizer, 1,000 sentences: mean prompt 30.6 tokens, longest 66;
batches 0..74 of experiments.zo_paper.steps.batch_rows(0, it, 1000, 512)), mean tokens per forward of a batch of 512:
  real tokens 15,665; padded to the batch's longest row 32,795 (2.09x the real ones);
  bucketed (<= 4 chunks of >= 64 rows, the default) 18,651 (1.19x real): 1.76x fewer tokens than one padded
  chunk (<= 8 chunks of >= 64 rows: 17,534, 1.87x; <= 2 chunks: 1.47x). Evaluation splits (whole split,
  4 chunks): val 32,500 -> 18,010 tokens, test 66,000 -> 36,872 (1.8x).
(experiments.zo_paper.paper.padding_report recomputes these numbers from the cached data.) On CPU (real SmolLM2
classifier, fp32, one thread, batch 64 in <= 4 chunks of >= 16 rows, 4 batches) the bucketed forward took
1.59x less CPU time for 1.58x fewer tokens (experiments/zo_paper/results/tf32/bucketing_cpu.json).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids (N, T) int64, mask (N, T) int64, labels (N,) int64
Buckets = tuple[Split, ...]  # chunks of one batch, each trimmed to its own longest row


def length_buckets(lengths: Sequence[int] | torch.Tensor, max_chunks: int = 4,
                   min_rows: int = 64) -> list[tuple[torch.Tensor, int]]:
    """Split rows of the given token lengths into length-sorted chunks that minimise padded tokens.

    Args:
        lengths: (N,) real tokens per row (ints >= 1; a CPU tensor or sequence; a CUDA tensor is copied).
        max_chunks: at most this many chunks (>= 1).
        min_rows: every chunk has at least this many rows (>= 1); a batch of fewer than 2·min_rows rows is
            one chunk.
    Returns:
        [(rows (n_c,) int64 CPU indices into the batch, ascending length, stable; t_c the chunk's longest
        row)], in ascending t_c; the chunks' rows partition range(N). The split minimises Σ n_c · t_c; ties
        go to fewer chunks, then to the earliest boundary. A pure function of (lengths, max_chunks, min_rows).
    Raises:
        ValueError: N == 0, a length < 1, max_chunks < 1 or min_rows < 1.
    """
    lens = torch.as_tensor(lengths).detach().to("cpu", torch.int64).reshape(-1)
    n = int(lens.numel())
    if n == 0 or max_chunks < 1 or min_rows < 1:
        raise ValueError(f"need rows, max_chunks >= 1 and min_rows >= 1; got N={n}, max_chunks={max_chunks}, "
                         f"min_rows={min_rows}")
    if int(lens.min()) < 1:
        raise ValueError("every row needs at least one real token")
    srt, order = torch.sort(lens, stable=True)
    cuts = _best_cuts(srt, max_chunks, min_rows)
    bounds = [0, *cuts, n]
    return [(order[a:b].clone(), int(srt[b - 1])) for a, b in itertools.pairwise(bounds)]


def _best_cuts(srt: torch.Tensor, max_chunks: int, min_rows: int) -> list[int]:
    """Interior boundaries (ascending) of the optimal split of ascending lengths `srt` (the DP of
    length_buckets). cost[i, j] = (j − i) · srt[j − 1] for a chunk of sorted rows i..j−1 (inf below min_rows)."""
    n = int(srt.numel())
    k_max = min(max_chunks, n // min_rows) if n >= min_rows else 1
    if k_max <= 1:
        return []
    idx = torch.arange(n + 1, dtype=torch.int64)
    size = idx[None, :] - idx[:, None]  # (i, j) -> j - i
    top = torch.cat([srt[:1], srt])  # top[j] = srt[j - 1] for j >= 1
    cost = (size * top[None, :]).to(torch.float64)
    cost[size < min_rows] = float("inf")
    best = cost[0].clone()  # best[j]: rows 0..j-1 in one chunk
    back: list[torch.Tensor] = []
    totals = [float(best[n])]
    for _ in range(2, k_max + 1):
        cand = best[:, None] + cost  # (i, j): best split of 0..i-1, then chunk i..j-1
        best, arg = cand.min(0)  # min returns the first (earliest) i among equal minima
        back.append(arg)
        totals.append(float(best[n]))
    k = min(range(len(totals)), key=lambda c: (totals[c], c)) + 1  # fewest chunks among equal costs
    cuts, j = [], n
    for c in range(k - 1, 0, -1):
        j = int(back[c - 1][j])
        cuts.append(j)
    return sorted(cuts)


def padded_tokens(lengths: Sequence[int] | torch.Tensor, max_chunks: int = 4, min_rows: int = 64) -> dict[str, int]:
    """{"real": Σ lengths, "one_chunk": N · max length, "bucketed": Σ n_c · t_c of length_buckets, "chunks"}."""
    lens = torch.as_tensor(lengths).to("cpu", torch.int64).reshape(-1)
    ch = length_buckets(lens, max_chunks, min_rows)
    return {"real": int(lens.sum()), "one_chunk": int(lens.numel()) * int(lens.max()),
            "bucketed": sum(int(r.numel()) * t for r, t in ch), "chunks": len(ch)}


def bucket_batch(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor | None = None,
                 max_chunks: int = 4, min_rows: int = 64) -> Buckets:
    """One right-padded batch as length_buckets chunks, each (ids[rows, :t], mask[rows, :t], labels[rows]).

    ids / mask (N, T) int64, labels (N,) on any device; `lengths` (N,) CPU int64 = mask.sum(1), passed to
    avoid a device sync (computed from mask when None). Raises ValueError as length_buckets, or when a
    length exceeds T.
    """
    if lengths is None:
        lengths = mask.sum(1).cpu()
    if int(lengths.max()) > ids.shape[1]:
        raise ValueError(f"a row has {int(lengths.max())} tokens but the batch is {ids.shape[1]} wide")
    out = []
    for rows, t in length_buckets(lengths, max_chunks, min_rows):
        r = rows.to(ids.device)
        out.append((ids[r, :t], mask[r, :t], labels[r]))
    return tuple(out)


def bucketed_ce(model, buckets: Buckets) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over all rows, scalar fp32 tensor in nats; correct rows, int64 scalar tensor) of
    `model` (a classifier: model(input_ids=, attention_mask=).logits (n, C)) on the chunks: Σ_rows CE / N,
    the same mean as one unbucketed forward. Differentiable (the AdamW arm backpropagates through it)."""
    n = sum(int(b[2].shape[0]) for b in buckets)
    total, right = None, None
    for ids, mask, labels in buckets:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        ok = (logits.argmax(-1) == labels).sum()
        total = ce if total is None else total + ce
        right = ok if right is None else right + ok
    return total / n, right
