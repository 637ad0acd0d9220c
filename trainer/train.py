"""The training loop: AdamW backprop baseline and a seam (`TrainMode`) for the ZO modes.

One loop serves every optimizer: it draws counter-based batches (a pure function of (seed, step)),
asks the mode for one optimizer step, evaluates on the held-out split every `eval_every` steps, writes
metrics as JSON lines, checkpoints as safetensors and plots the loss curves. Because batches, the
learning-rate schedule and all randomness are functions of the step counter, a resumed run continues
bit-identically on CPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainConfig, lr_at
from trainer.paths import runs_dir
from trainer.report import plot_loss_curves, read_metrics

CHECKPOINT_NAME = "checkpoint.safetensors"


class TrainMode(Protocol):
    """One optimizer step strategy. Backprop AdamW lives here; the ZO modes live in trainer.zo."""

    optimizer: torch.optim.Optimizer | None

    def step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor], lr: float) -> dict[str, float]:
        """Run optimizer step `step` (0-based) on `batch` = (x, y), int64 (B, T); return logged scalars."""
        ...

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and JSON state beyond the model and optimizer, for checkpoints."""
        ...

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""
        ...


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (nats) of a causal LM: x, y int64 (B, T), y = x shifted by one. Scalar."""
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


class AdamWMode:
    """Backprop AdamW with decoupled weight decay on matrices only and global-norm gradient clipping."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig) -> None:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.model, self.cfg = model, cfg
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False,
        )

    def step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor], lr: float) -> dict[str, float]:
        x, y = batch
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(self.model, x, y)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        self.optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(gnorm)}

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        return None


@dataclass(frozen=True)
class RunResult:
    """What a finished (or resumed-and-finished) run produced. Losses in nats/token; wall time in seconds."""

    run_dir: Path
    steps: int
    initial_val_loss: float
    final_val_loss: float
    wall_s: float
    summary: dict[str, Any]


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens, cfg: TrainConfig) -> float:
    """Mean validation loss over a fixed set of `cfg.eval_batches` windows of the held-out split."""
    from trainer.data import iter_eval_batches

    was_training = model.training
    model.eval()
    losses = [
        float(lm_loss(model, x.to(cfg.device), y.to(cfg.device)))
        for x, y in iter_eval_batches(tokens, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    ]
    model.train(was_training)
    if not losses:
        raise ValueError("the validation split is shorter than one batch; lower --batch-size/--seq-len")
    return sum(losses) / len(losses)


def build_mode(cfg: TrainConfig, model: torch.nn.Module) -> TrainMode:
    """Return the step strategy for `cfg.optimizer` (AdamW here, ZO modes from trainer.zo)."""
    if cfg.optimizer == "adamw":
        return AdamWMode(model, cfg)
    from trainer.zo.modes import build_zo_mode  # the ZO modes are optional weight on the import graph

    return build_zo_mode(cfg, model)


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C into a flag checked between steps (a step is never cut in half).

    A second Ctrl-C interrupts at once. Outside the main thread signals cannot be caught: no-op.
    """
    hit = {"n": 0}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        hit["n"] += 1
        if hit["n"] > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: hit["n"] > 0
    finally:
        signal.signal(signal.SIGINT, previous)


def default_run_dir(cfg: TrainConfig) -> Path:
    """`runs/<model>-<corpus>-<optimizer>-s<seed>` under `trainer.paths.runs_dir()`."""
    return runs_dir() / f"{cfg.model}-{cfg.corpus}-{cfg.optimizer}-s{cfg.seed}"


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    mode_factory: Callable[[TrainConfig, torch.nn.Module], TrainMode] | None = None,
    status: Callable[[], str] | None = None,
) -> RunResult:
    """Run (or resume) a training run and write its run folder.

    The folder holds `config.json`, `metrics.jsonl` (one record per step and per evaluation),
    `checkpoint.safetensors` (every `checkpoint_every` steps and at the end), `loss.png` and
    `summary.json`. `mode_factory` replaces `build_mode` (e.g. a ZO-Curv mode whose probes go to a
    fleet); `status` adds a live line (workers, probes/s) to the progress display.

    Raises:
        ValueError: unknown model preset or corpus, or a folder holding a different run's config.
        trainer.checkpoint.CheckpointError: `resume` with no usable checkpoint.
    """
    from trainer.data import get_batch, load_corpus
    from trainer.models import build_model, param_order_hash

    if cfg.task != "lm":
        raise ValueError(f"train() runs causal-LM pretraining; task {cfg.task!r} runs through "
                         "`sparecycles bench zo --part sentiment` (trainer.zo.bench)")
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_json = cfg.model_dump(mode="json", exclude={"run_dir", "steps"})
    cfg_path, metrics_path, ckpt_path = run_dir / "config.json", run_dir / "metrics.jsonl", run_dir / CHECKPOINT_NAME
    if resume and cfg_path.is_file():
        old = json.loads(cfg_path.read_text())
        if old != cfg_json:
            diff = sorted(k for k in set(old) | set(cfg_json) if old.get(k) != cfg_json.get(k))
            raise ValueError(f"--resume with a different config than {cfg_path} (fields: {diff})")
    cfg_path.write_text(json.dumps(cfg_json, indent=2))

    corpus = load_corpus(cfg.corpus)
    model = build_model(cfg.model, seed=cfg.seed, device=cfg.device)
    model.train()
    mode = (mode_factory or build_mode)(cfg, model)
    start = 0
    if resume:
        start, meta, extra = load_checkpoint(ckpt_path, model=model, optimizer=mode.optimizer)
        mode.load_extra_state(extra, meta.get("mode", {}))
        kept = [r for r in read_metrics(metrics_path) if r["step"] <= start]  # logged before that checkpoint
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    else:
        metrics_path.write_text("")
    history = read_metrics(metrics_path)
    initial = next((r["val_loss"] for r in history if "val_loss" in r and r["step"] == 0), None)

    from trainer import metrics as prom

    def log(rec: dict[str, Any]) -> None:
        with metrics_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        prom.record(cfg.optimizer, rec, cfg.batch_size * cfg.seq_len)

    def checkpoint(step: int) -> None:
        tensors, meta = mode.extra_state()
        save_checkpoint(ckpt_path, model=model, optimizer=mode.optimizer, step=step,
                        meta={"config": cfg_json, "param_order_hash": param_order_hash(model), "mode": meta},
                        extra=tensors)

    if initial is None:
        initial = evaluate(model, corpus.val, cfg)
        log({"step": 0, "val_loss": initial})
    t0 = time.perf_counter()
    last_val = initial
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def one_step(step: int) -> tuple[int, str]:
        nonlocal last_val
        lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        x, y = get_batch(corpus.train, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        stats = mode.step(step, (x.to(cfg.device), y.to(cfg.device)), lr)
        if not math.isfinite(stats.get("loss", 0.0)):
            raise FloatingPointError(f"loss became non-finite at step {step}; lower --lr")
        done = step + 1
        log({"step": done, "lr": lr, "tokens": done * tokens_per_step,
             "elapsed_s": time.perf_counter() - t0, **stats})
        if done % cfg.eval_every == 0 or done == cfg.steps:
            last_val = evaluate(model, corpus.val, cfg)
            log({"step": done, "val_loss": last_val})
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            checkpoint(done)
        return done, f"loss {stats.get('loss', float('nan')):.3f} val {last_val:.3f}"

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[status]}"), disable=not progress) as bar:
        task = bar.add_task(f"{cfg.optimizer} {cfg.model}", total=cfg.steps, completed=start, status="")
        done = start
        with _deferred_interrupt() as interrupted:
            try:
                for step in range(start, cfg.steps):
                    done, text = one_step(step)
                    bar.update(task, completed=done, status=f"{text} | {status()}" if status else text)
                    if interrupted():
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                checkpoint(done)  # keep the position reached; `--resume` continues from here
                raise
    wall = time.perf_counter() - t0
    records = read_metrics(metrics_path)
    plot_loss_curves({cfg.optimizer: records}, run_dir / "loss.png",
                     title=f"{cfg.model} on {cfg.corpus} ({cfg.optimizer})")
    summary = {
        "model": cfg.model, "corpus": cfg.corpus, "optimizer": cfg.optimizer, "steps": cfg.steps,
        "initial_val_loss": initial, "final_val_loss": last_val, "wall_s_this_invocation": wall,
        "tokens": cfg.steps * tokens_per_step, "resumed_from_step": start, "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(run_dir, cfg.steps, initial, last_val, wall, summary)
