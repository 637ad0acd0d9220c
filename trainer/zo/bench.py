"""Side-by-side benchmarks of the ZO modes on real data (DESIGN.md §2, issue "Must show").

1. `lm_comparison`: gpt2-tiny on a pretraining corpus, AdamW vs each ZO-Curv variant at equal optimizer
   steps (trainer.train.train, same seed, batches and schedule): final validation loss and the first
   evaluated step at which each variant reaches AdamW's final validation loss.
2. `sentiment_comparison`: the MiniLM classifier (pretrained encoder, new head) fine-tuned by MeZO,
   1SPSA(K) and 1.5-SPSA(K) at equal numbers of forward passes; test accuracy curves, best lr per method
   picked on the validation split.
Writes JSON summaries and PNG figures into `out_dir`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.sentiment import SentimentTask, classifier_loss  # re-exported: the benchmark's task and loss

ZOCURV_VARIANTS = ("zocurv-block", "zocurv-sophia", "zocurv-line")


def lm_comparison(out_dir: Path, *, steps: int = 600, device: str = "cpu", batch_size: int = 16,
                  seq_len: int = 128, lr: float = 3e-3, probes: int = 32, curvature_interval: int = 10,
                  eval_every: int = 50, seed: int = 0, variants=ZOCURV_VARIANTS) -> dict[str, Any]:
    """Train AdamW and each ZO-Curv variant for `steps` steps; return and write `lm_summary.json` + PNG."""
    from trainer.config import TrainConfig
    from trainer.report import read_metrics
    from trainer.train import train

    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[tuple[int, float]]] = {}
    summary: dict[str, Any] = {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                               "probes": probes, "curvature_interval": curvature_interval, "runs": {}}
    for opt in ("adamw", *variants):
        cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer=opt, steps=steps,
                          batch_size=batch_size, seq_len=seq_len, lr=lr, warmup_steps=max(1, steps // 10),
                          eval_every=eval_every, eval_batches=16, checkpoint_every=steps, probes=probes,
                          probe_batch_size=batch_size, curvature_interval=curvature_interval, seed=seed,
                          device=device, run_dir=out_dir / "runs" / opt)
        t0 = time.perf_counter()
        res = train(cfg, progress=False)
        recs = read_metrics(res.run_dir / "metrics.jsonl")
        curves[opt] = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        last = [r for r in recs if "loss" in r][-1]
        summary["runs"][opt] = {"final_val_loss": res.final_val_loss, "wall_s": time.perf_counter() - t0,
                                "forward_passes": last.get("forward_passes", steps),
                                "val_curve": curves[opt],
                                "last_logged": {k: v for k, v in last.items() if isinstance(v, float)}}
    target = summary["runs"]["adamw"]["final_val_loss"]
    for opt, run in summary["runs"].items():
        hit = [s for s, v in curves[opt] if v <= target]
        run["steps_to_adamw_final"] = hit[0] if hit else None
        run["step_ratio_vs_adamw"] = hit[0] / steps if hit else None
    (out_dir / "lm_summary.json").write_text(json.dumps(summary, indent=2))
    _plot({k: v for k, v in curves.items()}, out_dir / "lm_val_loss.png", "optimizer step",
          "validation loss (nats/token)", f"gpt2-tiny on classics-small, {steps} steps")
    return summary


def _plot(curves: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=".", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sentiment_run(task: SentimentTask, method: str, *, lr: float, budget: int, probes: int, eps: float,
                  alpha: float, lam: float, batch_size: int, seed: int, device: str, evals: int = 10) -> dict:
    """Fine-tune a fresh MiniLM classifier with a pure-ZO method until `budget` forward passes are spent.

    Returns curves of (forward passes, val acc, test acc) at ~`evals` evenly spaced points.
    """
    from trainer.models import load_minilm_classifier
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.zo_step import ZOStepper

    model, _ = load_minilm_classifier(seed=seed)
    model.to(device).eval()
    stepper = ZOStepper(model, method, run_seed=seed, probes=probes, eps=eps, alpha=alpha, lam=lam)
    backend = InProcessBackend(model, classifier_loss)
    per_step = 2 * stepper.k + (method == "1.5spsa")
    n_steps = budget // per_step
    eval_at = {round(n_steps * (i + 1) / evals) for i in range(evals)}
    curve = [(0, task.accuracy(model, "val"), task.accuracy(model, "test"))]
    losses, diverged = [], False
    for step in range(n_steps):
        stats = stepper.step(step, task.batch(batch_size, seed, step), backend, lr)
        losses.append(stats["loss"])
        if not math.isfinite(stats["loss"]):
            diverged = True
            break
        if step + 1 in eval_at:
            curve.append(((step + 1) * per_step, task.accuracy(model, "val"), task.accuracy(model, "test")))
    return {"method": method, "lr": lr, "probes": stepper.k, "steps": n_steps, "curve": curve,
            "train_loss_first_last": [float(np.mean(losses[:20])), float(np.mean(losses[-20:]))],
            "diverged": diverged}


def sentiment_backprop_baseline(task: SentimentTask, *, steps: int, lr: float = 5e-5, batch_size: int = 32,
                                seed: int = 0, device: str = "cpu", evals: int = 10) -> dict:
    """Context for the ZO runs: the same fresh MiniLM classifier fine-tuned by backprop AdamW (wd 0).

    Returns a curve of (optimizer steps, val acc, test acc). Each step costs one forward and one backward.
    """
    from trainer.models import load_minilm_classifier

    model, _ = load_minilm_classifier(seed=seed)
    model.to(device).eval()  # eval: dropout is 0 anyway; keeps the forward deterministic
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve = [(0, task.accuracy(model, "val"), task.accuracy(model, "test"))]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        classifier_loss(model, task.batch(batch_size, seed, step)).backward()
        opt.step()
        if (step + 1) % max(1, steps // evals) == 0:
            curve.append((step + 1, task.accuracy(model, "val"), task.accuracy(model, "test")))
    return {"method": "adamw-backprop", "lr": lr, "steps": steps, "curve": curve}


def sentiment_comparison(out_dir: Path, *, budget: int = 6000, device: str = "cpu", probes: int = 16,
                         lrs=(1e-5, 1e-4, 1e-3), eps: float = 1e-3, alpha: float = 0.1, lam: float = 1.0,
                         batch_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """MeZO vs 1SPSA vs 1.5-SPSA at equal forward passes; lr picked per method on validation accuracy."""
    from transformers import AutoTokenizer

    from trainer.data import load_sentiment
    from trainer.models.pretrained import minilm_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    task = SentimentTask(AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True), load_sentiment(),
                         device=device)
    runs = []
    for method in ("mezo", "1spsa", "1.5spsa"):
        for lr in lrs:
            t0 = time.perf_counter()
            r = sentiment_run(task, method, lr=lr, budget=budget, probes=probes, eps=eps, alpha=alpha, lam=lam,
                              batch_size=batch_size, seed=seed, device=device)
            r["wall_s"] = time.perf_counter() - t0
            runs.append(r)
            print(json.dumps(r), flush=True)
    best = {}
    for method in ("mezo", "1spsa", "1.5spsa"):
        ok = [r for r in runs if r["method"] == method and not r["diverged"]]
        if ok:
            b = max(ok, key=lambda r: r["curve"][-1][1])
            best[method] = {"lr": b["lr"], "final_val_acc": b["curve"][-1][1], "final_test_acc": b["curve"][-1][2],
                            "initial_test_acc": b["curve"][0][2], "steps": b["steps"]}
    summary = {"budget_forward_passes": budget, "probes": probes, "eps": eps, "alpha": alpha, "lam": lam,
               "batch_size": batch_size, "best": best, "runs": runs}
    (out_dir / "sentiment_summary.json").write_text(json.dumps(summary, indent=2))
    curves = {f"{m} (lr {best[m]['lr']:g})": [(f, te) for f, _, te in
                                              next(r for r in runs if r["method"] == m and r["lr"] == best[m]["lr"])
                                              ["curve"]] for m in best}
    _plot(curves, out_dir / "sentiment_test_acc.png", "forward passes", "test accuracy",
          f"MiniLM sentiment: ZO fine-tuning at equal forward passes (K={probes})")
    return summary
