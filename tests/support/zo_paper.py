"""A tiny classifier and data set for the paper-regime experiment's tests (experiments.zo_paper): the
PromptClassifier interface on a mean-pooled embedding, and labelled rows whose words tell the label."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class TinyClassifier(torch.nn.Module):
    """Mean-pooled embedding + linear head: a classifier with the PromptClassifier interface (seeded, 20 words)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(20, 4, generator=g) * 0.5)
        self.head = torch.nn.Parameter(torch.randn(2, 4, generator=g) * 0.5)

    def forward(self, input_ids, attention_mask):
        m = attention_mask[..., None].to(self.emb.dtype)
        x = (self.emb[input_ids] * m).sum(1) / m.sum(1)
        return SimpleNamespace(logits=x @ self.head.T)


def tiny_paper_data():
    """experiments.zo_paper's PaperData of 40 train, 20 val and 30 test rows of 6 ids: words 0-9 for label 0,
    10-19 for label 1 (seeded)."""
    from experiments.zo_paper.paper import PaperData

    g = torch.Generator().manual_seed(1)
    out = {}
    for name, n in (("train", 40), ("val", 20), ("test", 30)):
        labels = torch.randint(0, 2, (n,), generator=g)
        ids = torch.randint(0, 10, (n, 6), generator=g) + 10 * labels[:, None]  # the words tell the label
        out[name] = (ids, torch.ones_like(ids), labels)
    return PaperData(out)
