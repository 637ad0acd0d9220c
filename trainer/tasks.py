"""What a run trains on: the `Task` protocol, causal-LM pretraining (`LMTask`) and its loss and evaluation.

The sentiment task lives in trainer.sentiment (`SentimentRunTask`); `build_task` picks by `cfg.task`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trainer.config import TrainConfig
from trainer.data import get_batch, load_corpus
from trainer.evaluation import EvalWindows, evaluate_all, lm_windows
from trainer.models.causal_lm import build_causal_lm, model_label
from trainer.models.losses import lm_batch_loss, lm_loss  # noqa: F401  (lm_loss: public here, trainer.train re-exports it)
from trainer.sentiment import SentimentRunTask


class Task(Protocol):
    """What the loop trains on: LM pretraining (`LMTask`) or sentiment (trainer.sentiment.SentimentRunTask)."""

    model_name: str
    data_name: str
    tokens_per_step: int

    def build_model(self) -> torch.nn.Module:
        """A fresh model initialised from cfg.seed."""
        ...

    def batch(self, step: int) -> Any:
        """Training batch of 0-based `step`, a pure function of (cfg.seed, step), on cfg.device."""
        ...

    def loss_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss (nats) of `model` on `batch`."""
        ...

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics; always includes "val_loss"."""
        ...

    def eval_windows(self, full: bool = False) -> EvalWindows:
        """The held-out inputs `evaluate` scores (full: the whole validation split instead of the run's subset)."""
        ...

    def final(self, model: torch.nn.Module) -> dict[str, Any]:
        """Extra end-of-run metrics for summary.json (e.g. test accuracy)."""
        ...


class LMTask:
    """Causal-LM pretraining of `cfg.model` on `cfg.corpus`, or on the user's text `cfg.data` (trainer.data.user:
    packed with the model's tokenizer, cached by content) when set.

    Raises ValueError for an unknown corpus, bad `--data` input or a split smaller than one batch (here) or an
    unknown model preset (in build_model).
    """

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.data is None:
            self.corpus, self.data_name = load_corpus(cfg.corpus), cfg.corpus
        else:
            from trainer.data.user import check_fits, load_user_corpus

            self.corpus = load_user_corpus(cfg.data, cfg.model, text_field=cfg.text_field,
                                           encoding_errors=cfg.encoding_errors)
            check_fits(self.corpus, cfg.data, cfg.batch_size, cfg.seq_len)
            self.data_name = self.corpus.name
        self.cfg, self.model_name = cfg, model_label(cfg.model)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self._windows: dict[bool, EvalWindows] = {}

    loss_fn = staticmethod(lm_batch_loss)

    def build_model(self) -> torch.nn.Module:
        model, info = build_causal_lm(self.cfg.model, seed=self.cfg.seed, device=self.cfg.device)
        if self.cfg.seq_len > info.context:
            raise ValueError(f"--seq-len {self.cfg.seq_len} exceeds {self.cfg.model}'s context of "
                             f"{info.context} tokens")
        self.model_info = info
        return model

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = get_batch(self.corpus.train, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        return x.to(cfg.device), y.to(cfg.device)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return evaluate_all(model, self.eval_windows(), self.cfg.device)

    def eval_windows(self, full: bool = False) -> EvalWindows:
        key = bool(full)
        if key not in self._windows:
            cfg = self.cfg
            self._windows[key] = lm_windows(self.corpus.val, cfg.batch_size, cfg.seq_len,
                                            None if full else cfg.eval_batches, split=f"{self.data_name}/val")
        return self._windows[key]

    def final(self, model: torch.nn.Module) -> dict[str, Any]:
        return {}


def build_task(cfg: TrainConfig) -> Task:
    """The Task of `cfg.task`: "lm" -> LMTask, "sentiment" -> trainer.sentiment.SentimentRunTask."""
    if cfg.task == "sentiment":
        return SentimentRunTask(cfg)
    return LMTask(cfg)


def evaluate(model: torch.nn.Module, tokens, cfg: TrainConfig) -> float:
    """Mean validation loss over a fixed set of `cfg.eval_batches` windows of the held-out split
    (trainer.evaluation: the batch losses' mean, as a fleet worker computes it too)."""
    return evaluate_all(model, lm_windows(tokens, cfg.batch_size, cfg.seq_len, cfg.eval_batches), cfg.device)["val_loss"]
