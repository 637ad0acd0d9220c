"""Side-by-side benchmarks of the ZO modes on real data (DESIGN.md §2, issue "Must show").

1. `lm_comparison`: gpt2-tiny on a pretraining corpus, AdamW vs each ZO-Curv variant at equal optimizer
   steps (trainer.train.train, same seed, batches and schedule): final validation loss and the first
   evaluated step at which each variant reaches AdamW's final validation loss.
2. `sentiment_comparison`: a sentiment classifier fine-tuned by MeZO, 1SPSA(K) and 1.5-SPSA(K) at equal
   numbers of forward passes; test accuracy curves, best lr per method picked on the validation split.
   `model` "minilm": MiniLM-L6 (pretrained encoder, new head); "smollm2": SmolLM2-135M-Instruct as a
   prompt + label-word classifier over all its parameters (trainer.prompt_classifier, MeZO's setting).
Writes JSON summaries and PNG figures into `out_dir`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.sentiment import SentimentTask, classifier_loss  # re-exported: the benchmark's task and loss

ZOCURV_VARIANTS = ("zocurv-block", "zocurv-sophia", "zocurv-line")
SENTIMENT_MODELS = ("minilm", "smollm2")
# head_init values per model; the first is the default. SmolLM2 has no head: it starts as the zero-shot prompt.
HEAD_INITS = {"minilm": ("random", "linear-probe"), "smollm2": ("prompt",)}
BACKPROP_LR = {"minilm": 5e-5, "smollm2": 1e-5}  # AdamW baseline lr (MeZO's fine-tuning grid holds 1e-5)
MODEL_TITLES = {"minilm": "MiniLM", "smollm2": "SmolLM2-135M"}
# lm_comparison's TrainConfig settings besides steps, lr, probes, seed and device
LM_SETTINGS = {"batch_size": 16, "seq_len": 128, "curvature_interval": 10, "eval_every": 50}


@dataclass(frozen=True)
class SentimentSpec:
    """What every run of a sentiment sweep shares: the classifier (`model` "minilm" or "smollm2", its `head_init`,
    resolve_head_init), forward passes per run (`budget`), probes K and the ZO constants (eps, alpha, lam), the
    batch, seed and device, and the number of accuracy evaluations per run."""

    model: str = "minilm"
    head_init: str | None = None
    budget: int = 6000
    probes: int = 16
    eps: float = 1e-3
    alpha: float = 0.1
    lam: float = 1.0
    batch_size: int = 32
    seed: int = 0
    device: str = "cpu"
    evals: int = 10


def lm_comparison(out_dir: Path, steps: int = 600, device: str = "cpu", probes: int = 32, seed: int = 0,
                  variants=ZOCURV_VARIANTS, lr: float = 3e-3) -> dict[str, Any]:
    """Train AdamW and each ZO-Curv variant for `steps` steps at `lr` (gpt2-tiny on classics-small, LM_SETTINGS'
    batch and intervals; `probes` per curvature round); return and write `lm_summary.json` + PNG."""
    from trainer.config import TrainConfig
    from trainer.report import read_metrics
    from trainer.train import train

    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[tuple[int, float]]] = {}
    lm = LM_SETTINGS
    summary: dict[str, Any] = {"steps": steps, "batch_size": lm["batch_size"], "seq_len": lm["seq_len"],
                               "lr": lr, "probes": probes, "curvature_interval": lm["curvature_interval"],
                               "runs": {}}
    for opt in ("adamw", *variants):
        cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer=opt, steps=steps, lr=lr, **lm,
                          warmup_steps=max(1, steps // 10), eval_batches=16, checkpoint_every=steps, probes=probes,
                          probe_batch_size=lm["batch_size"], seed=seed, device=device, run_dir=out_dir / "runs" / opt)
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
    ax.set_title(title, fontsize=10)  # long two-line titles stay inside the figure
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def _pooled_features(model, task: SentimentTask, split: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(features (N, H) fp32 = what the head sees (BERT pooler output), labels (N,), forward batches used)."""
    ids, mask, labels = task.splits[split]
    feats, n_fwd = [], 0
    for i in range(0, ids.shape[0], batch_size):
        b = task._trim(ids[i:i + batch_size], mask[i:i + batch_size], labels[i:i + batch_size])
        feats.append(model.bert(input_ids=b[0], attention_mask=b[1]).pooler_output.float())
        n_fwd += 1
    return torch.cat(feats), labels, n_fwd


def fit_linear_probe_head_(model, task: SentimentTask, *, batch_size: int = 32, l2: float = 1e-3,
                           iters: int = 100) -> dict[str, float]:
    """Fit the classifier head on frozen features (L2-regularised logistic regression, full-batch L-BFGS) and
    write it into `model.classifier` in place: the "LP" of LP-FT (Kumar et al. 2022, "Fine-Tuning can Distort
    Pretrained Features", section 4), the forward-only stand-in for MeZO's prompt-based start (Malladi et
    al. 2023, section 2). Costs one forward pass per `batch_size` training sentences, returned as
    "forward_passes" (int), with the probe's training accuracy ("train_acc").
    """
    x, y, n_fwd = _pooled_features(model, task, "train", batch_size)
    w = torch.zeros(model.classifier.weight.shape, device=x.device, requires_grad=True)  # (C, H)
    b = torch.zeros(model.classifier.bias.shape, device=x.device, requires_grad=True)  # (C,)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        with torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum()
            loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        model.classifier.weight.copy_(w.detach().to(model.classifier.weight.dtype))
        model.classifier.bias.copy_(b.detach().to(model.classifier.bias.dtype))
        acc = float(((x @ w.T + b).argmax(-1) == y).float().mean())
    return {"forward_passes": n_fwd, "train_acc": acc}


def resolve_head_init(model: str, head_init: str | None) -> str:
    """The start of `model`'s classifier: head_init, or the model's default when None ("random" for minilm,
    "prompt" for smollm2). Raises ValueError for an unknown model or a start the model does not have."""
    if model not in SENTIMENT_MODELS:
        raise ValueError(f"model must be one of {SENTIMENT_MODELS}, got {model!r}")
    if head_init is None:
        return HEAD_INITS[model][0]
    if head_init not in HEAD_INITS[model]:
        why = " (SmolLM2 has no head: it starts from the zero-shot prompt)" if model == "smollm2" else ""
        raise ValueError(f"head_init for {model} must be one of {HEAD_INITS[model]}{why}, got {head_init!r}")
    return head_init


def sentiment_task(model: str = "minilm", device: str = "cpu") -> SentimentTask:
    """The tokenized sentiment splits for `model`: MiniLM's tokenizer at 64 tokens, or SmolLM2's prompts
    (trainer.prompt_classifier.PROMPT_TEMPLATE, SMOLLM2_MAX_LEN tokens, right-padded). Raises ValueError
    for an unknown model; FetchError / DataFetchError when data or tokenizer files are unavailable."""
    from transformers import AutoTokenizer

    from trainer.data import load_sentiment

    if model not in SENTIMENT_MODELS:
        raise ValueError(f"model must be one of {SENTIMENT_MODELS}, got {model!r}")
    if model == "minilm":
        from trainer.models.pretrained import minilm_dir

        return SentimentTask(AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True), load_sentiment(),
                             device=device)
    from trainer.models.pretrained import smollm2_dir
    from trainer.prompt_classifier import PROMPT_TEMPLATE, SMOLLM2_MAX_LEN, prompt_tokenizer

    # right-padded: PromptClassifier reads the label at mask.sum(1) - 1
    tok = prompt_tokenizer(AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True))
    return SentimentTask(tok, load_sentiment(), max_len=SMOLLM2_MAX_LEN, device=device, template=PROMPT_TEMPLATE)


def _fresh_classifier(task: SentimentTask, seed: int, device: str, head_init: str, batch_size: int,
                      model_name: str = "minilm"):
    """(classifier on `device`, eval mode, fp32; linear-probe stats or None). SmolLM2's start does not
    depend on `seed` (no new parameters)."""
    from trainer.models import load_minilm_classifier

    head_init = resolve_head_init(model_name, head_init)
    if model_name == "smollm2":
        from trainer.prompt_classifier import load_smollm2_prompt_classifier

        model, _ = load_smollm2_prompt_classifier()
        return model.to(device).eval(), None
    model, _ = load_minilm_classifier(seed=seed)
    model.to(device).eval()
    lp = fit_linear_probe_head_(model, task, batch_size=batch_size) if head_init == "linear-probe" else None
    return model, lp


def sentiment_run(task: SentimentTask, method: str, lr: float, spec: SentimentSpec, on_eval=None) -> dict:
    """Fine-tune a fresh classifier (spec.model: "minilm" or "smollm2", built on the matching `sentiment_task`)
    with a pure-ZO method at `lr` until spec.budget forward passes are spent.

    spec.head_init (minilm) "random" (BERT init, the default) or "linear-probe" (fit_linear_probe_head_ first;
    its forward passes are reported as "head_forward_passes" and not counted in the budget); smollm2 starts
    from the zero-shot prompt ("prompt", its only start). Returns curves of (forward passes, val acc,
    test acc) at ~spec.evals evenly spaced points; `on_eval(partial_result)` is called after each (so a run
    stopped early still leaves its curve). Raises ValueError for an unknown model or head_init.
    """
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.zo_step import ZOStepper

    model, seed, batch_size = spec.model, spec.seed, spec.batch_size
    head_init = resolve_head_init(model, spec.head_init)
    net, lp = _fresh_classifier(task, seed, spec.device, head_init, batch_size, model)
    stepper = ZOStepper(net, method, run_seed=seed, probes=spec.probes, eps=spec.eps, alpha=spec.alpha,
                        lam=spec.lam)
    backend = InProcessBackend(net, classifier_loss)
    per_step = forwards_per_step(method, spec.probes)
    n_steps = spec.budget // per_step
    eval_at = {round(n_steps * (i + 1) / spec.evals) for i in range(spec.evals)}
    curve = [(0, task.accuracy(net, "val"), task.accuracy(net, "test"))]
    losses, diverged = [], False

    def result(done: int) -> dict:
        return {"method": method, "lr": lr, "probes": stepper.k, "steps": done, "planned_steps": n_steps,
                "curve": curve, "model": model, "head_init": head_init,
                "head_forward_passes": lp["forward_passes"] if lp else 0,
                "train_loss_first_last": [float(np.mean(losses[:20] or [math.nan])),
                                          float(np.mean(losses[-20:] or [math.nan]))], "diverged": diverged}

    if on_eval is not None:  # the start too: a run stopped before its first step still leaves its point
        on_eval(result(0))

    for step in range(n_steps):
        stats = stepper.step(step, task.batch(batch_size, seed, step), backend, lr)
        losses.append(stats["loss"])
        if not math.isfinite(stats["loss"]):
            diverged = True
            break
        if step + 1 in eval_at:
            curve.append(((step + 1) * per_step, task.accuracy(net, "val"), task.accuracy(net, "test")))
            if on_eval is not None:
                on_eval(result(step + 1))
    return result(len(losses))


def sentiment_backprop_baseline(task: SentimentTask, spec: SentimentSpec, steps: int,
                                lr: float | None = None) -> dict:
    """Context for the ZO runs: the same fresh classifier (spec's model, head, batch, seed, device, evaluations)
    fine-tuned by backprop AdamW (wd 0) for `steps` steps, lr BACKPROP_LR[model] when None (5e-5 MiniLM, 1e-5
    SmolLM2).

    Returns a curve of (optimizer steps, val acc, test acc). Each step costs one forward and one backward.
    Raises ValueError for an unknown model or head_init.
    """
    model, seed, batch_size, evals = spec.model, spec.seed, spec.batch_size, spec.evals
    head_init = resolve_head_init(model, spec.head_init)
    lr = BACKPROP_LR[model] if lr is None else lr
    net, _ = _fresh_classifier(task, seed, spec.device, head_init, batch_size, model)  # eval mode: dropout is 0
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    curve = [(0, task.accuracy(net, "val"), task.accuracy(net, "test"))]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        classifier_loss(net, task.batch(batch_size, seed, step)).backward()
        opt.step()
        if (step + 1) % max(1, steps // evals) == 0:
            curve.append((step + 1, task.accuracy(net, "val"), task.accuracy(net, "test")))
    return {"method": "adamw-backprop", "lr": lr, "steps": steps, "curve": curve, "model": model,
            "head_init": head_init}


def sentiment_comparison(out_dir: Path, spec: SentimentSpec = SentimentSpec(), lrs=(1e-5, 1e-4, 1e-3),
                         methods=("mezo", "1spsa", "1.5spsa"), backprop_steps: int = 0,
                         backprop_lr: float | None = None) -> dict[str, Any]:
    """Sweep `methods` x `lrs` at equal forward passes on spec.model ("minilm" or "smollm2"), write
    `sentiment_runs-<methods>.json`, then summarise every runs file in `out_dir` (`sentiment_summary`), so
    several processes can share one sweep (of one model: the summary refuses a mix).

    With `backprop_steps` > 0 the backprop AdamW baseline (lr `backprop_lr`, default BACKPROP_LR[model])
    runs too, as method "adamw-backprop". Raises ValueError for an unknown model or head_init.
    """
    model = spec.model
    spec = replace(spec, head_init=resolve_head_init(model, spec.head_init))
    check_sentiment_folder(out_dir, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = sentiment_task(model, spec.device)
    tag = "-".join(methods) + "-lr" + "_".join(f"{lr:g}" for lr in lrs) + ("-backprop" if backprop_steps else "")
    meta = {"budget_forward_passes": spec.budget, "probes": spec.probes, "eps": spec.eps, "alpha": spec.alpha,
            "lam": spec.lam, "batch_size": spec.batch_size, "head_init": spec.head_init, "device": spec.device,
            "model": model}
    runs: list[dict] = []

    def save(partial: dict | None = None) -> None:  # after every evaluation: a stopped sweep keeps its curves
        done = runs + ([dict(partial, partial=True)] if partial else [])
        (out_dir / f"sentiment_runs-{tag}.json").write_text(json.dumps({"meta": meta, "runs": done}, indent=2))

    for method in methods:
        for lr in lrs:
            t0 = time.perf_counter()
            r = sentiment_run(task, method, lr, spec,
                              on_eval=lambda p, t0=t0, method=method, lr=lr: (save(dict(p, wall_s=time.perf_counter() - t0)),
                                                        print(f"{method} lr {lr:g}: {p['curve'][-1]}", flush=True)))
            r["wall_s"] = time.perf_counter() - t0
            runs.append(r)
            save()
            print(json.dumps(r), flush=True)
    if backprop_steps:
        r = sentiment_backprop_baseline(task, spec, backprop_steps, backprop_lr)
        runs.append(r)
        print(json.dumps(r), flush=True)
    save()
    return sentiment_summary(out_dir)


def reach_ratio(curve_a: list, curve_b: list) -> dict[str, Any]:
    """How much sooner curve A reaches B's final test accuracy: curves are [(forward passes, val, test)].

    Returns {"target_test_acc", "a_forwards_to_target" (first point of A at or above it, None if never),
    "b_forwards", "forward_ratio" (b_forwards / a_forwards), "final_gap_points" (100 * (A final - B final))}.
    """
    target, b_fwd = curve_b[-1][2], curve_b[-1][0]
    hit = next((f for f, _, te in curve_a if te >= target and f > 0), None)
    return {"target_test_acc": target, "a_forwards_to_target": hit, "b_forwards": b_fwd,
            "forward_ratio": b_fwd / hit if hit else None, "final_gap_points": 100 * (curve_a[-1][2] - target)}


def forwards_per_step(method: str, probes: int) -> int:
    """Forward passes one ZO step costs: 2 per probe (MeZO always has 1 probe), +1 clean pass for 1.5-SPSA."""
    return 2 * (1 if method == "mezo" else probes) + (method == "1.5spsa")


def check_sentiment_folder(out_dir: Path, model: str) -> None:
    """Raise ValueError if `out_dir` already holds sentiment runs of another model than `model` (the summary
    would refuse the mix only after the sweep ran). A missing folder is fine."""
    for f in sorted(Path(out_dir).glob("sentiment_runs-*.json")):
        other = json.loads(f.read_text())["meta"].get("model", "minilm")
        if other != model:
            raise ValueError(f"{out_dir} holds {other} sentiment runs ({f.name}); use another --out for {model}")


def sentiment_summary(out_dir: Path) -> dict[str, Any]:
    """Merge every `sentiment_runs-*.json` in `out_dir`: best lr per method on final validation accuracy,
    1.5-SPSA vs MeZO (`reach_ratio`), `sentiment_summary.json` (with "model") and `sentiment_test_acc.png`.
    Raises FileNotFoundError when no runs file exists, ValueError when the files hold runs of several
    models (files without meta "model" are MiniLM's, from before SmolLM2)."""
    files = sorted(out_dir.glob("sentiment_runs-*.json"))
    if not files:
        raise FileNotFoundError(f"no sentiment_runs-*.json in {out_dir}")
    loaded = [json.loads(f.read_text()) for f in files]
    models = {d["meta"].get("model", "minilm") for d in loaded}
    if len(models) > 1:
        raise ValueError(f"{out_dir} holds sentiment runs of several models {sorted(models)}; use one folder per model")
    model = models.pop()
    runs = [r for d in loaded for r in d["runs"]]
    best = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        ok = [r for r in runs if r["method"] == method and not r.get("diverged")]
        if ok:
            b = max(ok, key=lambda r: r["curve"][-1][1])
            best[method] = {"lr": b["lr"], "final_val_acc": b["curve"][-1][1], "final_test_acc": b["curve"][-1][2],
                            "initial_test_acc": b["curve"][0][2], "steps": b["steps"], "curve": b["curve"]}
    summary: dict[str, Any] = {"model": model, "meta": loaded[0]["meta"], "best": best, "runs": runs}
    if "1.5spsa" in best and "mezo" in best:
        summary["1.5spsa_vs_mezo"] = reach_ratio(best["1.5spsa"]["curve"], best["mezo"]["curve"])
    (out_dir / "sentiment_summary.json").write_text(json.dumps(summary, indent=2))
    curves = {f"{m} (lr {b['lr']:g})": [(f, te) for f, _, te in b["curve"]] for m, b in best.items()
              if m != "adamw-backprop"}
    meta = loaded[0]["meta"]
    _plot(curves, out_dir / "sentiment_test_acc.png", "forward passes", "test accuracy",
          f"{MODEL_TITLES[model]} sentiment, ZO fine-tuning at equal forward passes\n"
          f"(K={meta['probes']}, head {meta['head_init']})")
    return summary
