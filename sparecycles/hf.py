"""The fleet for a Hugging Face `Trainer`: `FleetCallback` (a transformers.TrainerCallback) and `lm_compute_loss`.

    callback = FleetCallback(windows, fleet=sc.connect(url), eval_every=50, anytime_tokens=select_tokens,
                             run_dir="run")
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=sc.hf.windows_dataset(windows),
                      compute_loss_func=lm_compute_loss, callbacks=[callback],
                      optimizers=(callback.zocurv(model, lr=3e-4), None))   # optional: ZO-Curv multipliers

Every `eval_every` optimizer steps and at the end of training the callback hands the weights to the fleet
(sparecycles.loop.Evaluation: the records land in `callback.records` and in the Trainer's log as
`fleet_eval_loss`); the anytime model keeps versions after each step, chooses at the end and is exported as a
transformers folder (`RUN_DIR/anytime`). The dataset convention is the fleet's: rows {"input_ids": x, "labels": y}
with y = x shifted by one already, and `lm_compute_loss` (no shift; the mean token cross-entropy, fp32) is the loss
the workers compute, so Trainer.evaluate on `windows_dataset(windows)` scores the fleet's windows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from sparecycles.loop import AnytimeModel, Evaluation, Fleet, ZOCurv
from trainer.evaluation import EvalWindows
from wire.bounds import check_share


def lm_compute_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Trainer's `compute_loss_func`: mean token cross-entropy (nats) of logits (B, T, V) against labels (B, T)
    int64 already shifted (trainer.models.losses.lm_loss, the workers' loss). Scalar fp32."""
    logits = outputs.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


class WindowsDataset(torch.utils.data.Dataset):
    """Rows of EvalWindows (lm) as Trainer examples {"input_ids": x (T,), "labels": y (T,)}, in order."""

    def __init__(self, windows: EvalWindows) -> None:
        if windows.kind != "lm":
            raise ValueError(f"windows_dataset takes lm windows, got {windows.kind!r}")
        self.x, self.y = windows.tensors

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def windows_dataset(windows: EvalWindows) -> WindowsDataset:
    """The Trainer dataset of `windows` (evaluate it with per_device_eval_batch_size = windows.batch_size)."""
    return WindowsDataset(windows)


class FleetCallback(TrainerCallback):
    """transformers.TrainerCallback giving a Trainer's model the fleet's services (module docstring).

    Args:
        windows: held-out lm windows the fleet evaluates (trainer.evaluation.lm_windows).
        fleet: from sparecycles.connect; None evaluates in process (same records, `eval_on: "trainer"`).
        eval_every: optimizer steps between evaluations (0: only at the end).
        anytime_tokens: a selection split ((N,) token ids) for the anytime model (None: none);
        anytime: AnytimeSettings fields, and `batch_size` and `seq_len` of the anytime selection windows (default:
            the evaluation windows'). run_dir: where served.safetensors and `anytime/` (the export) go.
        deadline_s: seconds without a fleet result before a version is evaluated here.
        share: the pool share of this training's coordinator runs (as `sparecycles.connect(share=)`; None: the
            fleet's, default 1); needs `fleet`.
    """

    def __init__(self, windows: EvalWindows, *, fleet: Fleet | None = None, eval_every: int = 0,
                 anytime_tokens=None, anytime: dict[str, Any] | None = None, run_dir: str | Path = "run",
                 deadline_s: float = 120.0, share: float | None = None) -> None:
        if eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {eval_every}")
        if share is not None:
            if fleet is None:
                raise ValueError("share is a share of a fleet's pool: it needs `fleet`")
            fleet = dataclasses.replace(fleet, share=check_share(share))
        self.windows, self.fleet, self.eval_every, self.deadline_s = windows, fleet, eval_every, deadline_s
        settings = dict(anytime or {})
        self.batch_size = settings.pop("batch_size", None) or windows.batch_size
        self.seq_len = settings.pop("seq_len", None) or int(windows.tensors[0].shape[1])
        self.anytime_tokens, self.anytime_settings, self.run_dir = anytime_tokens, settings or None, Path(run_dir)
        self.evaluation: Evaluation | None = None
        self.anytime: AnytimeModel | None = None
        self.optimizer = None
        self.records: list[dict[str, Any]] = []
        self.served: dict[str, Any] | None = None
        self.export_dir: Path | None = None
        self._hook = None

    def zocurv(self, model: torch.nn.Module, **settings: Any):
        """A ZO-Curv optimizer (sparecycles.loop.ZOCurv on this callback's fleet) for Trainer's `optimizers=`; the
        callback feeds it each training batch's first rows as probe batch (a forward pre-hook: (x[:, :-1], x[:, 1:])
        of the input ids)."""
        self.optimizer = ZOCurv(model, fleet=self.fleet, **settings)

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if module.training and torch.is_grad_enabled() and ids is not None:
                self.optimizer.probe_batch((ids[:, :-1], ids[:, 1:]))

        self._hook = model.register_forward_pre_hook(hook, with_kwargs=True)
        return self.optimizer

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.evaluation = Evaluation(model, self.windows, fleet=self.fleet, deadline_s=self.deadline_s,
                                     device=str(next(model.parameters()).device))
        if self.anytime_tokens is not None:
            self.anytime = AnytimeModel(model, self.anytime_tokens, batch_size=self.batch_size, seq_len=self.seq_len,
                                        run_dir=self.run_dir, settings=self.anytime_settings,
                                        evaluation=self.evaluation, device=str(next(model.parameters()).device))

    def on_step_end(self, args, state, control, model=None, **kw):
        step = state.global_step
        if self.anytime is not None:
            self.anytime.after_step(step)
        due = self.eval_every and step % self.eval_every == 0 and step < state.max_steps
        self._log(state, self.evaluation.request(step) if due else self.evaluation.poll())

    def on_train_end(self, args, state, control, model=None, **kw):
        step = state.global_step
        if not any(r["step"] == step for r in self.records):
            self._log(state, self.evaluation.request(step))
        self._log(state, self.evaluation.finish())
        if self.anytime is not None:
            self.served = self.anytime.choose(step)
            self.export_dir = self.anytime.export(self.run_dir / "anytime")
        self.evaluation.close()
        if self.optimizer is not None:
            self.optimizer.close()
        if self._hook is not None:
            self._hook.remove()

    def _log(self, state, got: list[dict[str, Any]]) -> None:
        self.records += got
        for r in got:
            state.log_history.append({"step": r["step"], "fleet_eval_loss": r["val_loss"], "eval_on": r["eval_on"]})
