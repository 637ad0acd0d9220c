"""Held-out evaluation as fixed windows split into batches: the one loss code of the trainer and the probe workers.

An evaluation is a list of batch values over `EvalWindows` (the held-out windows or sentences of a split,
selected once per run, on the CPU), combined in batch order:

- LM (`kind "lm"`): batch k = windows [kB, (k+1)B) of the split (trainer.data.iter_eval_batches' windows);
  its value is the batch's mean token cross-entropy (nats/token, `lm_loss`); val_loss = the mean of the
  batch values (as the trainer always computed it).
- classifier (`kind "classifier"`): batch k = sentences [kB, (k+1)B) of the selected rows, trimmed to its
  longest sentence; its values are the summed cross-entropy (nats) and the count classified right;
  val_loss = Σ loss / n, val_acc = Σ right / n.

`batch_values` is what a trainer and a worker both run for one batch (same model code, same fp32 reduction),
and `combine` is the one way values become a record, so a fleet-evaluated record equals the trainer-evaluated
one bit for bit on the same device (tests/fleet/test_fleet_eval.py). `InlineEvaluator` is the loop's default
(evaluate now, on the trainer); fleet.evaluation.FleetEvaluator hands versions to the fleet instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from trainer.data import iter_eval_batches
from trainer.models.losses import lm_loss

EvalKind = Literal["lm", "classifier"]


@dataclass(frozen=True)
class EvalWindows:
    """The selected held-out inputs of one run: `tensors` (CPU int64; lm: x, y (M, T); classifier: ids (M, T),
    mask (M, T), labels (M,)) in batches of `batch_size` rows; `split` names where they come from."""

    kind: EvalKind
    split: str
    tensors: tuple[torch.Tensor, ...]
    batch_size: int

    @property
    def rows(self) -> int:
        return int(self.tensors[0].shape[0])

    @property
    def n_batches(self) -> int:
        return -(-self.rows // self.batch_size)

    def batch(self, k: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
        """Batch `k` (0 <= k < n_batches) on `device`. Raises IndexError out of range."""
        return batch_of(self.tensors, self.batch_size, k, device)


def batch_of(tensors: tuple[torch.Tensor, ...], batch_size: int, k: int,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """Rows [k·batch_size, (k+1)·batch_size) of each tensor, contiguous, on `device`. Raises IndexError."""
    rows = int(tensors[0].shape[0])
    if not 0 <= k * batch_size < rows:
        raise IndexError(f"evaluation batch {k} is outside {-(-rows // batch_size)} batches of {batch_size}")
    return tuple(t[k * batch_size:(k + 1) * batch_size].contiguous().to(device) for t in tensors)


def lm_windows(tokens, batch_size: int, seq_len: int, max_batches: int | None, split: str = "val") -> EvalWindows:
    """The windows trainer.data.iter_eval_batches yields (`max_batches` batches, None: the whole split), stacked."""
    xs, ys = zip(*iter_eval_batches(tokens, batch_size, seq_len, max_batches), strict=True)
    if not xs:
        raise ValueError("the validation split is shorter than one batch; lower --batch-size/--seq-len")
    return EvalWindows("lm", split, (torch.cat(xs), torch.cat(ys)), batch_size)


@torch.no_grad()
def batch_values(model: torch.nn.Module, kind: EvalKind, batch: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(value, aux) of one evaluation batch on `model` (in eval mode; its mode is restored): lm -> (mean nats/token,
    0.0); classifier -> (summed nats, count right), on the batch trimmed to its longest sentence."""
    was_training = model.training
    model.eval()
    try:
        if kind == "lm":
            x, y = batch
            return float(lm_loss(model, x, y)), 0.0
        ids, mask, labels = batch
        t = int(mask.sum(1).max())
        logits = model(input_ids=ids[:, :t], attention_mask=mask[:, :t]).logits.float()  # (b, C)
        return float(F.cross_entropy(logits, labels, reduction="sum")), float(int((logits.argmax(-1) == labels).sum()))
    finally:
        model.train(was_training)


def combine(kind: EvalKind, values: list[tuple[float, float]], rows: int) -> dict[str, float]:
    """The record of an evaluation from its batch values in batch order (see the module docstring)."""
    if not values:
        raise ValueError("no evaluation batches")
    if kind == "lm":
        return {"val_loss": sum(v for v, _ in values) / len(values)}
    total, right = 0.0, 0.0
    for v, a in values:
        total += v
        right += a
    return {"val_loss": total / rows, "val_acc": right / rows}


def evaluate_windows(model: torch.nn.Module, windows: EvalWindows, device: str | torch.device,
                     batches: list[int] | None = None) -> dict[int, tuple[float, float]]:
    """`batch_values` of `batches` (default: all), keyed by batch index."""
    ks = range(windows.n_batches) if batches is None else batches
    return {k: batch_values(model, windows.kind, windows.batch(k, device)) for k in ks}


def evaluate_all(model: torch.nn.Module, windows: EvalWindows, device: str | torch.device) -> dict[str, float]:
    """The record of evaluating every batch of `windows` on `model` here."""
    got = evaluate_windows(model, windows, device)
    return combine(windows.kind, [got[k] for k in range(windows.n_batches)], windows.rows)


class Evaluator(Protocol):
    """How the loop evaluates (trainer.train): `request` at an evaluation step, `poll` every step, `finish` before
    the run reports. Each returns the records ready now ({"step": s, "val_loss": ..., ...}), in step order."""

    def request(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        ...

    def poll(self) -> list[dict[str, Any]]:
        ...

    def finish(self) -> list[dict[str, Any]]:
        ...


class InlineEvaluator:
    """Evaluate on the trainer, at once (`--eval-on trainer`): `task.evaluate(model)` at each requested step."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def request(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"step": step, **self.task.evaluate(model)}]

    def poll(self) -> list[dict[str, Any]]:
        return []

    def finish(self) -> list[dict[str, Any]]:
        return []


class InlineWindowsEvaluator:
    """Evaluate fixed `windows` on the trainer, at once (any loop's in-process evaluation: sparecycles.loop): the
    record of `evaluate_all`, {"step", "val_loss", "eval_on": "trainer"}, at each requested step."""

    def __init__(self, windows: EvalWindows, device: str | torch.device = "cpu") -> None:
        self.windows, self.device = windows, device

    def request(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"step": step, **evaluate_all(model, self.windows, self.device), "eval_on": "trainer"}]

    def poll(self) -> list[dict[str, Any]]:
        return []

    def finish(self) -> list[dict[str, Any]]:
        return []


def poll_quietly(evaluator: Evaluator) -> list[dict[str, Any]]:
    """`evaluator.poll()` on the way out of an interrupted run: the records ready, never a second error (logged)."""
    import logging

    try:
        return evaluator.poll()
    except Exception as exc:  # noqa: BLE001 - the interrupt is what ends the run
        logging.getLogger(__name__).warning("taking the evaluations of an interrupted run: %s", exc)
        return []
