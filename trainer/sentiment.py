"""The sentiment task for the training loop: the MiniLM-L6 classifier on the Rotten Tomatoes snippets.

`SentimentTask` holds the tokenized splits and draws counter-based batches; `classifier_loss` is the
loss every optimizer uses (backprop AdamW and the ZO probe backends alike); `SentimentRunTask` is the
`trainer.train.Task` that `train()` picks for `cfg.task == "sentiment"`. experiments.zo.bench re-exports
the first two for its side-by-side benchmark.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data import load_sentiment
from trainer.evaluation import EvalWindows, evaluate_all
from trainer.models import load_minilm_classifier

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
EVAL_SUBSET_KEY = 2024  # Philox key of the fixed validation subset (independent of the run seed)


class SentimentTask:
    """Tokenized sentiment splits for a sequence classifier: ids (N, T) int64, mask (N, T) int64, labels (N,) int64.

    Sentences are padded/truncated to `max_len` tokens; batches are trimmed to their longest sentence.
    Batches are pure functions of (seed, index): rows drawn by a Philox generator keyed on both.
    With `template` (a str.format pattern with one `{}`, e.g. trainer.prompt_classifier.PROMPT_TEMPLATE)
    each sentence is tokenized as template.format(sentence), and nothing is truncated: a prompt's end
    carries the label position. Raises ValueError when a templated sentence exceeds `max_len` tokens.
    """

    def __init__(self, tokenizer, data, max_len: int = 64, device: str = "cpu", template: str | None = None) -> None:
        self.device = device
        self.splits = {}
        for name in ("train", "val", "test"):
            rows = getattr(data, name)
            texts = [t for t, _ in rows] if template is None else [template.format(t) for t, _ in rows]
            if template is not None:
                longest = max(len(x) for x in tokenizer(texts)["input_ids"])
                if longest > max_len:
                    raise ValueError(f"a {name} prompt is {longest} tokens, over max_len {max_len}; raise max_len "
                                     "(prompts are never truncated: the label is read at their last token)")
            enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
            labels = torch.tensor([y for _, y in rows], dtype=torch.int64)
            self.splits[name] = (enc["input_ids"].to(device), enc["attention_mask"].to(device), labels.to(device))

    @staticmethod
    def _trim(ids, mask, labels):
        t = int(mask.sum(1).max())
        return ids[:, :t], mask[:, :t], labels

    def batch(self, batch_size: int, seed: int, index: int) -> Batch:
        """(input_ids (B, T), attention_mask (B, T), labels (B,)) of training batch `index`, rows without
        replacement. Raises ValueError if batch_size exceeds the training split."""
        ids, mask, labels = self.splits["train"]
        if not 1 <= batch_size <= ids.shape[0]:
            raise ValueError(f"batch_size must be in [1, {ids.shape[0]}] (training sentences), got {batch_size}")
        rng = np.random.Generator(np.random.Philox(key=seed, counter=[index, 0, 0, 0]))
        rows = torch.as_tensor(rng.choice(ids.shape[0], size=batch_size, replace=False), device=ids.device)
        return self._trim(ids[rows], mask[rows], labels[rows])

    def subset_rows(self, split: str, n: int, key: int = EVAL_SUBSET_KEY) -> torch.Tensor:
        """Indices (min(n, N),) int64, ascending, of a fixed random subset of `split`. The stored splits are
        ordered by label, so a prefix would be one class; the Philox key is fixed so every run (any seed)
        is scored on the same sentences."""
        total = self.splits[split][0].shape[0]
        rng = np.random.Generator(np.random.Philox(key=key))
        return torch.as_tensor(np.sort(rng.permutation(total)[:n]), dtype=torch.int64)

    @torch.no_grad()
    def loss_and_accuracy(self, model, split: str, rows: torch.Tensor | None = None,
                          chunk: int = 256) -> tuple[float, float]:
        """(mean cross-entropy in nats, fraction correct by argmax) over `rows` (int64 (n,)) of `split`, all
        rows when None. Raises ValueError for an unknown split or an empty selection."""
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        ids, mask, labels = self.splits[split]
        if rows is not None:
            rows = rows.to(ids.device)
            ids, mask, labels = ids[rows], mask[rows], labels[rows]
        n = ids.shape[0]
        if n < 1:
            raise ValueError(f"no rows to evaluate in split {split!r}")
        total, right = 0.0, 0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            b = self._trim(ids[i:j], mask[i:j], labels[i:j])
            logits = model(input_ids=b[0], attention_mask=b[1]).logits.float()  # (b, C)
            total += float(F.cross_entropy(logits, b[2], reduction="sum"))
            right += int((logits.argmax(-1) == b[2]).sum())
        return total / n, right / n

    def accuracy(self, model, split: str, chunk: int = 256) -> float:
        """Fraction of `split` classified correctly (argmax of the logits)."""
        return self.loss_and_accuracy(model, split, chunk=chunk)[1]


def classifier_loss(model, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy (nats, scalar) of a sequence classifier on (input_ids (B, T), attention_mask (B, T),
    labels (B,))."""
    ids, mask, labels = batch
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits.float(), labels)


class SentimentRunTask:
    """`trainer.train.Task` for `cfg.task == "sentiment"`: fine-tune MiniLM-L6 with a new 2-way head.

    Uses cfg.seq_len (max tokens per sentence), cfg.batch_size, cfg.seed, cfg.device and cfg.eval_batches;
    cfg.model and cfg.corpus are ignored. Evaluation runs on `eval_batches * batch_size`
    validation sentences of a fixed random subset (`SentimentTask.subset_rows`); `final` scores the whole test split.

    Raises:
        trainer.data.sources.DataFetchError / trainer.models.fetch.FetchError: data or weights unavailable.
    """

    model_name = "minilm-l6"
    data_name = "sentiment"

    def __init__(self, cfg) -> None:
        from transformers import AutoTokenizer

        from trainer.models.pretrained import minilm_dir

        self.cfg = cfg
        tokenizer = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
        self.data = SentimentTask(tokenizer, load_sentiment(), max_len=cfg.seq_len, device=cfg.device)
        self.eval_rows = self.data.subset_rows("val", cfg.eval_batches * cfg.batch_size)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len  # upper bound: batches are trimmed

    loss_fn = staticmethod(classifier_loss)

    def build_model(self) -> torch.nn.Module:
        """Pretrained encoder + head initialised from cfg.seed (trainer.models.load_minilm_classifier)."""
        model, _ = load_minilm_classifier(seed=self.cfg.seed)
        return model.to(self.cfg.device)

    def batch(self, step: int) -> Batch:
        """Training batch of 0-based `step`: a pure function of (cfg.seed, step)."""
        return self.data.batch(self.cfg.batch_size, self.cfg.seed, step)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """{"val_loss": nats, "val_acc": fraction} on the fixed validation subset."""
        return evaluate_all(model, self.eval_windows(), self.cfg.device)

    def eval_windows(self, full: bool = False):
        """trainer.evaluation.EvalWindows of the validation sentences `evaluate` scores (full: all of them), in
        batches of cfg.batch_size (the chunks loss_and_accuracy used), on the CPU."""
        ids, mask, labels = (t.cpu() for t in self.data.splits["val"])
        if not full:
            rows = self.eval_rows.cpu()
            ids, mask, labels = ids[rows], mask[rows], labels[rows]
        return EvalWindows("classifier", "sentiment/val", (ids, mask, labels), self.cfg.batch_size)

    def final(self, model: torch.nn.Module) -> dict[str, Any]:
        """{"test_loss", "test_acc", "test_sentences"} on the whole test split, for summary.json."""
        was_training = model.training
        model.eval()
        loss, acc = self.data.loss_and_accuracy(model, "test")
        model.train(was_training)
        return {"test_loss": loss, "test_acc": acc, "test_sentences": int(self.data.splits["test"][2].shape[0])}
