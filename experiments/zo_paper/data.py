"""The data of the paper comparison (experiments.zo_paper.paper): the paper's fixed train/val/test subsets as length-bucketed
batches (`PaperData`), the training loss that also keeps the batch accuracy for the plateau rule (`AccuracyLoss`),
and the standard error of an accuracy (`binomial_se`)."""

from __future__ import annotations

import math

import torch

from experiments.zo_paper.length_buckets import Buckets, Split, bucket_batch, bucketed_ce
from experiments.zo_paper.steps import PAPER, batch_rows

TRAIN_KEY, VAL_KEY, TEST_KEY = 181, 182, 183  # Philox keys of the fixed subsets (independent of the run seed)


def binomial_se(acc: float, n: int) -> float:
    """Standard error sqrt(p(1−p)/n) of an accuracy p measured on n sentences. Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.sqrt(max(acc * (1.0 - acc), 0.0) / n)


class PaperData:
    """The paper's splits: `splits` {"train", "val", "test"} of (ids, mask, labels), rows already chosen.

    `from_task(task)` takes fixed random subsets (SentimentTask.subset_rows, keys TRAIN/VAL/TEST_KEY) of
    PAPER.n_train training, n_val validation and n_test test sentences (fewer if a split is smaller).
    Batches and evaluations run length-bucketed (experiments.zo_paper.length_buckets: rows sorted by length into at
    most `max_chunks` chunks of >= `min_rows` rows, each trimmed to its longest row), which leaves every
    row's logits unchanged for a right-padded classifier whose logits do not depend on padding
    (PromptClassifier). `lengths` holds each split's row lengths on the CPU (no device sync per batch).
    """

    def __init__(self, splits: dict[str, Split], max_chunks: int = 4, min_rows: int = 64) -> None:
        missing = {"train", "val", "test"} - set(splits)
        if missing:
            raise ValueError(f"splits lack {sorted(missing)}")
        self.splits = splits
        self.max_chunks, self.min_rows = max_chunks, min_rows
        self.lengths = {k: v[1].sum(1).cpu() for k, v in splits.items()}
        self._eval: dict[str, Buckets] = {}

    @classmethod
    def from_task(cls, task, n_train: int = PAPER.n_train, n_val: int = PAPER.n_val,
                  n_test: int = PAPER.n_test) -> PaperData:
        out = {}
        for name, n, key in (("train", n_train, TRAIN_KEY), ("val", n_val, VAL_KEY), ("test", n_test, TEST_KEY)):
            rows = task.subset_rows(name, n, key=key)
            out[name] = tuple(t[rows.to(t.device)] for t in task.splits[name])
        return cls(out)

    def size(self, split: str) -> int:
        return int(self.splits[split][2].shape[0])

    def batch(self, seed: int, iteration: int, batch_size: int, max_chunks: int | None = None) -> Buckets:
        """Training batch `iteration`: the rows experiments.zo_paper.steps.batch_rows (with replacement) draws, as
        length-bucketed chunks (experiments.zo_paper.length_buckets.bucket_batch; the same rows as one padded batch).
        max_chunks: this batch's chunk limit (None: the data's; 1: one padded batch)."""
        rows = batch_rows(seed, iteration, self.size("train"), batch_size)
        ids, mask, labels = self.splits["train"]
        r = rows.to(ids.device)
        return bucket_batch(ids[r], mask[r], labels[r], self.lengths["train"][rows],
                            self.max_chunks if max_chunks is None else max_chunks, self.min_rows)

    def eval_buckets(self, split: str) -> Buckets:
        """The whole `split` as length-bucketed chunks (computed once, cached)."""
        if split not in self._eval:
            self._eval[split] = bucket_batch(*self.splits[split], self.lengths[split], self.max_chunks,
                                             self.min_rows)
        return self._eval[split]

    @torch.no_grad()
    def accuracy(self, model, split: str) -> float:
        """Fraction of `split` classified correctly (argmax of the logits), over length-bucketed chunks."""
        return int(bucketed_ce(model, self.eval_buckets(split))[1]) / self.size(split)


class AccuracyLoss:
    """Mean cross-entropy of a length-bucketed batch (experiments.zo_paper.length_buckets.bucketed_ce: Σ_rows CE / N,
    the unbucketed batch's mean) that also keeps the batch accuracy of the first call since `reset()` (the
    train accuracy of the plateau rule: the clean pass for 1.5-SPSA, θ+εz_1 for 1SPSA/MeZO, which have no
    clean pass). A plain (ids, mask, labels) batch is taken as one chunk."""

    def __init__(self) -> None:
        self.first_acc: float | None = None

    def reset(self) -> None:
        self.first_acc = None

    def __call__(self, model, batch: Buckets | Split) -> torch.Tensor:
        buckets = _as_buckets(batch)
        loss, right = bucketed_ce(model, buckets)
        if self.first_acc is None:
            self.first_acc = int(right) / sum(int(b[2].shape[0]) for b in buckets)
        return loss


def _as_buckets(batch: Buckets | Split) -> Buckets:
    """A Buckets tuple as is; a plain (ids, mask, labels) Split as one chunk."""
    return (batch,) if isinstance(batch[0], torch.Tensor) else batch
