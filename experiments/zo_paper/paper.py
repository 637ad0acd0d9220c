"""1.5-SPSA in its published regime, side by side with MeZO and backprop (issue 18; `python -m experiments.zo --regime paper`).

Arms (same data, prompt and label words; experiments.zo_paper.steps.PAPER holds the published numbers):
  A1      1.5-SPSA, K=40, batch 512 with replacement, lr=ε=1e-4, plateau halving, fp32 weights (project path)
  A2      A1 with bf16 weights perturbed in place (+ε, −2ε, +ε) and updated in place (the public code's numerics)
  A3      1SPSA(40) at lr 1e-4;  A3w: 1SPSA at 1e-4 × mean(w) of A1 (same step length as A1 on average)
  A4-16 / A4-128   A1 at batch 16 / 128 (A4 at 512 is A1)
  A5-<lr> MeZO at its own recipe: batch 16, ε=1e-3, one Gaussian probe, lr grid
  A6-<lr> backprop AdamW (wd 0), batch 16, two lrs
Every arm stops at its iteration cap or its share of the time budget, whichever comes first, and says which
(the shares are renormalised over the arms a call runs: experiments.zo_paper.plan). The arms can be split over
several calls (device calls are capped at 600 s): a call names its arms and merges an earlier call's
paper_summary.json (`include`), whose A1 log and step ledger ("ledgers") serve A3w's lr and the drift, and
an arm that stopped on time there can continue where it stopped (`resume`: its ledger is replayed).
Forwards run length-bucketed (experiments.zo_paper.length_buckets): the same per-row logits, ~1.8x fewer tokens.
Selection: the evaluated point with the best validation accuracy (500 sentences); test (1,000) is scored once,
at the end, on those weights. The test accuracy at every evaluated point is kept too, and its maximum is
reported as "best_on_test_peek" (selection on test: it shows how much peeking inflates).

This module runs the comparison (`paper_comparison`, `paper_main`) and tabulates and plots it; the parts live
beside it: zo_paper_data (the splits and the loss), zo_paper_arms (one arm), zo_paper_plan (arms, shares,
merging calls), zo_paper_steps (the steppers) and zo_paper_checks (side measurements). Their public names are
importable from here as before.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from experiments.zo_paper.arms import run_backprop_arm, run_zo_arm
from experiments.zo_paper.checks import h_precision_check, inplace_memory_scan, padding_report  # noqa: F401 (re-exported)
from experiments.zo_paper.data import AccuracyLoss, PaperData, binomial_se  # noqa: F401 (re-exported)
from experiments.zo_paper.plan import (
    MATMUL_MODES,
    a1_mean_w,
    arm_seconds,
    canonical_order,
    check_plan,
    merge_include,
    paper_arms,
)
from experiments.zo_paper.steps import PAPER, numerics_drift
from trainer.zo.probes import canonical_blocks

TAIL_S = 8.0  # seconds kept after the arms under a deadline: final JSON, plots
DRIFT_S_PER_STEP = 0.3  # estimated seconds of numerics_drift per A1 step on an H200 (40 probes of 134.5M weights)


@dataclass(frozen=True)
class PaperCall:
    """One call's plan of the paper comparison (paper_comparison's docstring says what each does): its seconds
    (`total_s`), the arms it runs (None: all), the seed, an earlier call's summary to merge (`include`, its
    json.load) and whether its arms stopped on time continue (`resume`), the fp32 matmul mode per arm (`matmul`),
    share weights, the drift, an iteration cap and a wall-clock deadline (`end_by`, time.time() seconds)."""

    total_s: float = 300.0
    arms: tuple[str, ...] | None = None
    seed: int = 0
    include: dict | None = None
    resume: bool = False
    matmul: dict[str, str] | None = None
    weights: dict[str, float] | None = None
    drift: bool = True
    iters_cap: int | None = None
    end_by: float | None = None


def paper_comparison(out_dir: Path, make_model: Callable[[torch.dtype], torch.nn.Module], data: PaperData,
                     call: PaperCall = PaperCall(), *, meta: dict | None = None,
                     set_matmul: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the arms (all, or those named in `arms`) within ~`total_s` seconds; write `paper_summary.json`
    (after every arm), `paper_curves.png` and `paper_hw.png` into `out_dir`.

    make_model(dtype) returns a fresh model on the device (fp32 for every arm but A2's bf16). Each arm gets
    zo_paper_plan.arm_seconds of what is left of `total_s` (shares renormalised over the arms run now;
    `weights` overrides some, zo_paper_plan.parse_weights) and stops early enough to end inside it; an arm
    that would start with no time left is skipped (meta.skipped). `include`: an earlier call's summary
    (json.load of its paper_summary.json), merged by zo_paper_plan.merge_include: its arms are kept unless run
    now, its A1 (log, step ledger) serves A3w's lr and the drift; with `resume`, an arm run now that stopped
    on time there continues from its last iteration (run_zo_arm's resume; A1/A3/A3w keep ledgers). `matmul`
    {arm: "highest" | "high"} is passed to `set_matmul` before each arm (CUDA's fp32 matmul precision; None
    on CPU) and recorded as the arm's "fp32_matmul". drift: measure A2's numerics against the fp32-master
    path by replaying A1's ledger from the bf16-rounded start (numerics_drift), once per ledger, after the
    arms (before them when A1 does not run in this call). iters_cap caps every arm's iterations (smoke tests).
    end_by: a wall-clock deadline (time.time() seconds) for the whole call: the arms' budget becomes
    min(total_s, what is left before end_by minus a tail for the final writes and an after-arms drift at
    DRIFT_S_PER_STEP per A1 iteration), so a device call ends in time however long loading took.
    Raises ValueError for unknown arms, or A3w without A1 (now or included)."""
    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    total_s, seed, include, matmul, iters_cap, drift = (call.total_s, call.seed, call.include, call.matmul,
                                                        call.iters_cap, call.drift)
    plan = paper_arms(total_s, call.arms, weights=call.weights)
    names_now = [a["name"] for a in plan]
    check_plan(names_now, include)
    inc = merge_include(include, names_now, call.resume)
    a1_moves = "A1" in names_now and "A1" not in inc["done"]
    if call.end_by is not None:
        total_s = _deadline_budget(total_s, plan, call.end_by, iters_cap, drift and a1_moves)
    record = {"total_s": total_s, "arms": names_now, "fp32_matmul": matmul if set_matmul else "cpu",
              "included": sorted(inc["arms"]), "resumed": sorted(inc["resume"]), "iters_cap": iters_cap,
              "weights": call.weights}
    summary = _new_summary(data, inc, record, meta, total_s, seed)
    results: dict[str, Any] = summary["arms"]
    skipped = dict.fromkeys(inc["done"], "finished in the included summary (kept)")

    def save() -> None:
        (out_dir / "paper_summary.json").write_text(json.dumps(summary, indent=2))

    if not a1_moves and drift:  # the ledger is final: measure now, inside the budget the arms share
        _measure_drift(summary, make_model, save)

    todo = [a for a in plan if a["name"] not in inc["done"]]
    for i, arm in enumerate(todo):
        left = total_s - (time.perf_counter() - t_start)
        arm = dict(arm, time_s=arm_seconds(arm["share"], sum(a["share"] for a in todo[i:]), left))
        if iters_cap is not None:
            arm["max_iters"] = min(arm["max_iters"], iters_cap)
        if left <= 0:
            skipped[arm["name"]] = "no time left in this call"
            continue
        cont = inc["resume"].get(arm["name"])
        arm = _arm_lr(arm, cont, results)
        if arm is None:
            skipped[todo[i]["name"]] = "A1 logged no w"
            continue
        _set_arm_matmul(arm, cont, matmul, set_matmul)
        r = _run_arm(data, make_model, arm, seed, cont)
        if "ledger" in r:  # the step ledger, for the drift (A1) and for resuming in a later call
            summary["ledgers"][arm["name"]] = r.pop("ledger")
            if arm["name"] == "A1":
                summary.pop("drift", None)
        results[arm["name"]] = r
        print(json.dumps({k: r[k] for k in ("name", "iterations", "stop", "val_acc", "test_acc", "wall_s")}),
              flush=True)
        save()
    if drift:
        _measure_drift(summary, make_model, save)
    summary["arms"] = {n: results[n] for n in canonical_order(list(results))}
    summary["meta"]["skipped"] = skipped
    summary["table"] = summary_table(summary["arms"])
    save()
    plot_paper(summary, out_dir)
    return summary


def _new_summary(data: PaperData, inc: dict[str, Any], call: dict[str, Any], meta: dict | None, total_s: float,
                 seed: int) -> dict[str, Any]:
    """The summary this call starts from: meta (the caller's, the budget, seed, regime, split sizes, the calls so
    far plus this `call`), the included arms (a dict the arms run now are added to), ledgers and drift (`inc`:
    zo_paper_plan.merge_include)."""
    summary: dict[str, Any] = {"meta": {**(meta or {}), "total_s": total_s, "seed": seed, "regime": PAPER.__dict__,
                                        "n": {s: data.size(s) for s in ("train", "val", "test")},
                                        "calls": [*inc["calls"], call]},
                               "arms": dict(inc["arms"]), "ledgers": dict(inc["ledgers"])}
    if inc["drift"] is not None:
        summary["drift"] = inc["drift"]
    return summary

def _deadline_budget(total_s: float, plan: list[dict], end_by: float, iters_cap: int | None,
                     drift_after: bool) -> float:
    """The arms' seconds under a wall-clock deadline `end_by` (time.time() seconds): min(total_s, what is left
    before end_by minus TAIL_S and, when the drift runs after the arms (`drift_after`), DRIFT_S_PER_STEP per A1
    iteration)."""
    a1_cap = min([a["max_iters"] for a in plan if a["name"] == "A1"] + [iters_cap or 10**9])
    tail = TAIL_S + (DRIFT_S_PER_STEP * a1_cap if drift_after else 0.0)
    return min(total_s, end_by - time.time() - tail)


def _measure_drift(summary: dict[str, Any], make_model: Callable[[torch.dtype], torch.nn.Module],
                   save: Callable[[], None]) -> None:
    """A2's numerics vs the fp32 master on A1's own steps (numerics_drift over summary["ledgers"]["A1"], from
    bf16 weights) into summary["drift"], then `save()`; nothing when there is no A1 ledger or its drift (same
    number of steps) is already there."""
    ledger = summary["ledgers"].get("A1")
    if not (ledger and summary.get("drift", {}).get("steps") != len(ledger)):
        return
    t0 = time.perf_counter()
    m = make_model(torch.bfloat16)
    blocks = canonical_blocks(m)
    summary["drift"] = {**numerics_drift([b.param.data for b in blocks], [b.offset for b in blocks], ledger),
                        "seconds": time.perf_counter() - t0}
    del m
    print(json.dumps({"drift": summary["drift"]}), flush=True)
    save()


def _arm_lr(arm: dict, cont: dict | None, results: dict[str, Any]) -> dict | None:
    """`arm` with the lr of an arm that takes it from A1 ("lr_from": PAPER.lr × A1's mean w; a resumed one keeps
    its earlier lr, `cont`, as A1's mean w may have moved since); None when A1 logged no w."""
    if cont is not None and arm.get("lr_from"):
        arm["lr"] = cont["lr"]
    elif arm.get("lr_from"):
        w = a1_mean_w(results)
        if w is None:
            return None
        arm = dict(arm, lr=PAPER.lr * w)
    return arm


def _set_arm_matmul(arm: dict, cont: dict | None, matmul: dict[str, str] | None,
                    set_matmul: Callable[[str], None] | None) -> None:
    """Record the arm's fp32 matmul mode in arm["fp32_matmul"] ("cpu" without `set_matmul`) and set it; warn when a
    resumed arm (`cont`) ran under another mode."""
    mode = (matmul or {}).get(arm["name"], "highest")
    arm["fp32_matmul"] = mode if set_matmul else "cpu"
    if cont is not None and cont.get("fp32_matmul") not in (None, arm["fp32_matmul"]):
        print(f"warning: {arm['name']} resumes with fp32 matmul {arm['fp32_matmul']} after "
              f"{cont['fp32_matmul']}", flush=True)
    if set_matmul:
        set_matmul(mode)


def _run_arm(data: PaperData, make_model: Callable[[torch.dtype], torch.nn.Module], arm: dict, seed: int,
             cont: dict | None) -> dict[str, Any]:
    """Run one arm on a fresh model: backprop, or ZO in bf16 (inplace numerics) or fp32, resuming from `cont`."""
    if arm.get("kind") == "backprop":
        return run_backprop_arm(data, make_model(torch.float32), arm, seed=seed)
    dtype = torch.bfloat16 if arm["numerics"] == "inplace" else torch.float32
    return run_zo_arm(data, make_model(dtype), arm, seed=seed, keep_ledger=bool(arm.get("keeps_ledger")),
                      resume=cont)


def summary_table(results: dict[str, Any]) -> list[dict]:
    """One row per arm: iterations, sequence-forwards, val/test accuracy with standard errors, test peek."""
    return [{"arm": n, "method": r.get("method"), "lr": r.get("lr"), "batch": r.get("batch_size"),
             "fp32_matmul": r.get("fp32_matmul"),
             "iterations": r["iterations"], "stop": r["stop"], "seq_forwards": r["seq_forwards"],
             "selected_iteration": r["selected_iteration"], "val_acc": r["val_acc"], "val_se": r["val_se"],
             "test_acc": r["test_acc"], "test_se": r["test_se"], "initial_test_acc": r["initial_test_acc"],
             "best_on_test_peek": r["best_on_test_peek"]["test_acc"]} for n, r in results.items()]


def plot_paper(summary: dict, out_dir: Path) -> None:
    """paper_curves.png (val accuracy vs iteration and vs sequence-forwards) and paper_hw.png (A1/A2 h and w)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for n, r in arms.items():
        it = [e["iteration"] for e in r["evals"]]
        v = [e["val_acc"] for e in r["evals"]]
        sf = [max(e["seq_forwards"], 1) for e in r["evals"]]
        a1.plot(it, v, marker=".", label=n)
        a2.plot(sf, v, marker=".", label=n)
    a1.set_xscale("symlog", linthresh=10)
    a2.set_xscale("log")
    for ax, xl in ((a1, "iteration (optimizer step)"), (a2, "sequence-forwards (forward passes x batch)")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation accuracy (500 sentences)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M sentiment, 1.5-SPSA published regime vs 1SPSA, MeZO, AdamW")
    fig.tight_layout()
    fig.savefig(out_dir / "paper_curves.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for n in ("A1", "A2", "A4-16", "A4-128"):
        log = [x for x in arms.get(n, {}).get("log", []) if "h_mean" in x]
        if not log:
            continue
        it = [x["iteration"] for x in log]
        axes[0].errorbar(it, [x["h_mean"] for x in log], yerr=[x["h_std"] for x in log], label=n, alpha=0.7)
        axes[1].plot(it, [x["w_mean"] for x in log], label=n)
        axes[2].plot(it, [x["frac_weight_floored"] for x in log], label=n)
    for ax, yl in zip(axes, ("h = (L+ + L- - 2 L0)/eps^2 (mean ± sd over K)", "mean w", "fraction of probes at 1/lambda")):
        ax.set_xlabel("iteration")
        ax.set_ylabel(yl, fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "paper_hw.png", dpi=120)
    plt.close(fig)


def paper_main(out_dir: Path, call: PaperCall = PaperCall(), *, device: str = "cuda",
               include: Path | None = None) -> dict[str, Any]:
    """`python -m experiments.zo --model smollm2 --regime paper`: SmolLM2-135M prompt classifier (trainer.prompt_classifier),
    loaded once and copied fresh for every arm (paper_comparison runs them, as `call` says).

    call.matmul: torch.set_float32_matmul_precision for the fp32 arms on CUDA, {arm: mode} (zo_paper_plan.
    parse_matmul; an arm left out: "highest"): "highest" (true fp32, the default) or "high" (TF32, about 2x
    faster). At ε = 1e-4, h needs the loss to ~1e-8·|h|: TF32 (and bf16) forwards put rounding noise 10-100x
    larger than h into it (experiments/zo_paper/results/tf32/RESULTS.md). include: an earlier call's
    paper_summary.json to merge (its arms kept unless re-run; its A1 serves A3w and the drift); it replaces
    call.include.
    Raises ValueError for an unknown mode or arm, A3w without A1; FetchError / DataFetchError when weights or
    data are unavailable; OSError / json.JSONDecodeError for an unreadable include."""
    from experiments.zo.bench import sentiment_task
    from trainer.prompt_classifier import load_smollm2_prompt_classifier

    names = [a["name"] for a in paper_arms(1.0, call.arms, weights=call.weights)]
    matmul = {n: (call.matmul or {}).get(n, "highest") for n in names}
    if any(m not in MATMUL_MODES for m in matmul.values()):
        raise ValueError(f"fp32 matmul modes are {MATMUL_MODES}, got {matmul}")
    inc = json.loads(Path(include).read_text()) if include is not None else None
    check_plan(names, inc)
    cuda = device.startswith("cuda")
    task = sentiment_task("smollm2", device)
    data = PaperData.from_task(task)
    base, _ = load_smollm2_prompt_classifier(torch.float32)

    def make_model(dtype: torch.dtype) -> torch.nn.Module:
        return copy.deepcopy(base).to(device=device, dtype=dtype).eval()

    meta = {"model": "smollm2", "device": device, "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "include": str(include) if include is not None else None}
    return paper_comparison(out_dir, make_model, data, replace(call, include=inc, matmul=matmul), meta=meta,
                            set_matmul=torch.set_float32_matmul_precision if cuda else None)
