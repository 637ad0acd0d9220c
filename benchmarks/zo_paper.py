"""1.5-SPSA in its published regime, side by side with MeZO and backprop (issue 18; `bench zo --regime paper`).

Arms (same data, prompt and label words; benchmarks.zo_paper_steps.PAPER holds the published numbers):
  A1      1.5-SPSA, K=40, batch 512 with replacement, lr=ε=1e-4, plateau halving, fp32 weights (project path)
  A2      A1 with bf16 weights perturbed in place (+ε, −2ε, +ε) and updated in place (the public code's numerics)
  A3      1SPSA(40) at lr 1e-4;  A3w: 1SPSA at 1e-4 × mean(w) of A1 (same step length as A1 on average)
  A4-16 / A4-128   A1 at batch 16 / 128 (A4 at 512 is A1)
  A5-<lr> MeZO at its own recipe: batch 16, ε=1e-3, one Gaussian probe, lr grid
  A6-<lr> backprop AdamW (wd 0), batch 16, two lrs
Every arm stops at its iteration cap or its share of the time budget, whichever comes first, and says which
(the shares are renormalised over the arms a call runs: benchmarks.zo_paper_plan). The arms can be split over
several calls (device calls are capped at 600 s): a call names its arms and merges an earlier call's
paper_summary.json (`include`), whose A1 log and step ledger ("ledgers") serve A3w's lr and the drift, and
an arm that stopped on time there can continue where it stopped (`resume`: its ledger is replayed).
Forwards run length-bucketed (benchmarks.length_buckets): the same per-row logits, ~1.8x fewer tokens.
Selection: the evaluated point with the best validation accuracy (500 sentences); test (1,000) is scored once,
at the end, on those weights. The test accuracy at every evaluated point is kept too, and its maximum is
reported as "best_on_test_peek" (selection on test: it shows how much peeking inflates).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.length_buckets import Buckets, Split, bucket_batch, bucketed_ce
from benchmarks.zo_paper_plan import (
    MATMUL_MODES,
    a1_mean_w,
    arm_seconds,
    canonical_order,
    check_plan,
    merge_include,
    paper_arms,
    parse_matmul,
)
from benchmarks.zo_paper_steps import (
    PAPER,
    PlateauState,
    ZOParamStepper,
    batch_rows,
    numerics_drift,
    plateau_update,
)
from trainer.zo.probes import canonical_blocks

TRAIN_KEY, VAL_KEY, TEST_KEY = 181, 182, 183  # Philox keys of the fixed subsets (independent of the run seed)
TAIL_S = 8.0  # seconds kept after the arms under a deadline: final JSON, plots
DRIFT_S_PER_STEP = 0.3  # estimated seconds of numerics_drift per A1 step on an H200 (40 probes of 134.5M weights)


def binomial_se(acc: float, n: int) -> float:
    """Standard error sqrt(p(1−p)/n) of an accuracy p measured on n sentences. Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.sqrt(max(acc * (1.0 - acc), 0.0) / n)


class PaperData:
    """The paper's splits: `splits` {"train", "val", "test"} of (ids, mask, labels), rows already chosen.

    `from_task(task)` takes fixed random subsets (SentimentTask.subset_rows, keys TRAIN/VAL/TEST_KEY) of
    PAPER.n_train training, n_val validation and n_test test sentences (fewer if a split is smaller).
    Batches and evaluations run length-bucketed (benchmarks.length_buckets: rows sorted by length into at
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
        """Training batch `iteration`: the rows benchmarks.zo_paper_steps.batch_rows (with replacement) draws, as
        length-bucketed chunks (benchmarks.length_buckets.bucket_batch; the same rows as one padded batch).
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
    """Mean cross-entropy of a length-bucketed batch (benchmarks.length_buckets.bucketed_ce: Σ_rows CE / N,
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


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters (the candidate weights of the validation selection)."""
    return [p.detach().clone() for p in model.parameters()]


def _finish(arm: dict, data: PaperData, model, best_state, evals: list, t0: float, stop: str,
            wall_before: float = 0.0) -> dict:
    """Select on validation, score test once on the selected weights, label the test peek. wall_s counts this
    call's seconds plus `wall_before` (a resumed arm's earlier calls)."""
    best = max(evals, key=lambda e: (e["val_acc"], -e["iteration"]))  # the earliest of equal bests
    with torch.no_grad():
        for p, s in zip(model.parameters(), best_state):
            p.copy_(s)
    test = data.accuracy(model, "test")
    peek = max(evals, key=lambda e: e["test_acc_peek"])
    n_val, n_test = data.size("val"), data.size("test")
    return {**arm, "stop": stop, "wall_s": wall_before + time.perf_counter() - t0, "evals": evals,
            "selected_iteration": best["iteration"], "val_acc": best["val_acc"],
            "val_se": binomial_se(best["val_acc"], n_val), "test_acc": test, "test_se": binomial_se(test, n_test),
            "initial_test_acc": evals[0]["test_acc_peek"],
            "best_on_test_peek": {"iteration": peek["iteration"], "test_acc": peek["test_acc_peek"],
                                  "label": "selected on TEST (peeking): an inflated upper bound"}}


def _eval_point(data: PaperData, model, it: int, seq_fwd: int, wall: float) -> dict:
    return {"iteration": it, "seq_forwards": seq_fwd, "wall_s": wall, "val_acc": data.accuracy(model, "val"),
            "test_acc_peek": data.accuracy(model, "test")}


def _resume_zo(stepper: ZOParamStepper, model: torch.nn.Module, arm: dict, resume: dict) -> dict[str, Any]:
    """Rebuild a master-numerics ZO arm where an earlier call stopped: replay its step ledger
    resume["ledger"] [[seeds, coeffs, eps], ...] on the fresh start (ZOParamStepper.apply, bit for bit),
    snapshot the weights at its selected iteration, rerun the plateau rule over its logged train accuracies
    and restore its forward count. Returns {"log", "evals", "ledger", "best_state", "state", "wall_before",
    "fingerprint_ok" (the replayed weights' fingerprint equals the one the earlier call stored; None if it
    stored none)}. Raises ValueError for inplace numerics or a ledger that does not match the log."""
    if stepper.numerics != "master":
        raise ValueError(f"{arm['name']}: only master-numerics arms resume (inplace drift is not replayable)")
    ledger, log = [list(e) for e in resume["ledger"]], list(resume["log"])
    if len(ledger) != len(log) or len(ledger) != resume["iterations"]:
        raise ValueError(f"{arm['name']}: ledger of {len(ledger)} steps for {len(log)} logged iterations")
    sel = resume["selected_iteration"]
    best_state = _snapshot(model) if sel == 0 else None
    for i, (seeds, coeffs, _eps) in enumerate(ledger):
        stepper.apply(seeds, coeffs)
        if i + 1 == sel:
            best_state = _snapshot(model)
    state = PlateauState()
    for row in log:
        state = plateau_update(state, row["train_acc"], arm.get("patience", PAPER.patience))
    stepper.forward_passes = resume["forward_passes"]
    fp = resume.get("fingerprint")
    return {"log": log, "evals": list(resume["evals"]), "ledger": ledger, "best_state": best_state, "state": state,
            "wall_before": resume["wall_s"], "fingerprint_ok": None if fp is None else stepper.fingerprint() == fp}


def run_zo_arm(data: PaperData, model: torch.nn.Module, arm: dict, *, seed: int = 0,
               keep_ledger: bool = False, resume: dict | None = None) -> dict[str, Any]:
    """Train `model` (consumed) with arm {"name", "method", "numerics", "lr", "eps", "batch_size", "probes",
    "max_iters", "time_s", "eval_every", "patience"}; returns the arm with per-iteration "log" (loss,
    train_acc, lr, eps, h_mean, h_std, w_mean, frac_weight_floored, g_abs_mean), "evals", the selection
    (_finish), "fingerprint" (ZOParamStepper.fingerprint of the last weights) and "ledger" [[seeds, coeffs,
    eps]] when keep_ledger. resume: this arm's result from an earlier call, with its "ledger" (master
    numerics; `model` must be the same fresh start): the run continues from its last iteration (_resume_zo)
    to max_iters or this call's time_s, as if never stopped; "resumed" records where it picked up."""
    t0 = time.perf_counter()
    stepper = ZOParamStepper(model, arm["method"], numerics=arm.get("numerics", "master"), run_seed=seed,
                             probes=arm.get("probes", PAPER.probes), alpha=arm.get("alpha", PAPER.alpha),
                             lam=arm.get("lam", PAPER.lam))
    loss_fn, state = AccuracyLoss(), PlateauState()
    bs = arm["batch_size"]
    resumed, wall_before = None, 0.0
    if resume is not None:
        r0 = _resume_zo(stepper, model, arm, resume)
        log, evals, ledger, best_state, state = r0["log"], r0["evals"], r0["ledger"], r0["best_state"], r0["state"]
        wall_before = r0["wall_before"]
        resumed = {"from_iteration": len(log), "fingerprint_ok": r0["fingerprint_ok"],
                   "replay_s": time.perf_counter() - t0}
        print(json.dumps({"arm": arm["name"], "resumed": resumed}), flush=True)
    else:
        evals = [_eval_point(data, model, 0, 0, 0.0)]
        best_state, log, ledger = _snapshot(model), [], []
    start, stop = len(log), "max_iters"
    for it in range(start, arm["max_iters"]):
        lr, eps = arm["lr"] * state.scale, arm["eps"] * state.scale
        loss_fn.reset()
        st = stepper.step(it, data.batch(seed, it, bs, arm.get("max_chunks")), loss_fn, lr, eps)
        if keep_ledger:
            ledger.append([st["seeds"], st["coeffs"], eps])
        state = plateau_update(state, loss_fn.first_acc, arm.get("patience", PAPER.patience))
        log.append({"iteration": it + 1, "loss": st["loss"], "train_acc": loss_fn.first_acc, "lr": lr, "eps": eps,
                    **{k: st[k] for k in ("h_mean", "h_std", "w_mean", "frac_weight_floored", "g_abs_mean")
                       if k in st}})
        if it - start < 3 or (it + 1) % arm["eval_every"] == 0:  # progress: the pace is known after the first line
            print(json.dumps({"arm": arm["name"], "iteration": it + 1, "wall_s": round(time.perf_counter() - t0, 2),
                              "s_per_iteration": round((time.perf_counter() - t0) / (it + 1 - start), 3),
                              **{k: log[-1][k] for k in ("loss", "train_acc", "h_mean", "w_mean") if k in log[-1]}}),
                  flush=True)
        if not math.isfinite(st["loss"]):
            stop = "diverged"
            break
        out_of_time, best_state = _after_iteration(data, model, arm, it, stepper.forward_passes * bs, t0, evals,
                                                   best_state, start, wall_before)
        if out_of_time:
            stop = "time"
            break
    fingerprint = stepper.fingerprint()  # of the last weights, before _finish loads the selected ones
    res = _finish(arm, data, model, best_state, evals, t0, stop, wall_before)
    res.update(iterations=len(log), forward_passes=stepper.forward_passes,
               seq_forwards=stepper.forward_passes * bs, log=log, fingerprint=fingerprint)
    if resumed is not None:
        res["resumed"] = [*resume.get("resumed", []), resumed]
    if keep_ledger:
        res["ledger"] = ledger
    return res


def _after_iteration(data: PaperData, model: torch.nn.Module, arm: dict, it: int, seq_forwards: int, t0: float,
                     evals: list[dict], best_state: Any, start: int = 0, wall_before: float = 0.0) -> tuple[bool, Any]:
    """After iteration `it` (0-based; this call began at iteration `start`): evaluate when due (every
    `eval_every`, the last iteration, or out of time), appending to `evals`; snapshot the model on a strict
    validation improvement (the earliest best, as `_finish` picks). Out of time: another iteration at this
    call's mean pace (evaluations included) would end past `time_s` seconds from t0, so an arm ends inside its
    share instead of one iteration after it. Eval wall_s adds `wall_before` (earlier calls). Returns (out of
    time, best state)."""
    spent = time.perf_counter() - t0
    out_of_time = spent + spent / (it + 1 - start) > arm["time_s"]
    if (it + 1) % arm["eval_every"] == 0 or out_of_time or it + 1 == arm["max_iters"]:
        e = _eval_point(data, model, it + 1, seq_forwards, wall_before + time.perf_counter() - t0)
        if e["val_acc"] > max(x["val_acc"] for x in evals):
            best_state = _snapshot(model)
        evals.append(e)
    return out_of_time, best_state


def run_backprop_arm(data: PaperData, model: torch.nn.Module, arm: dict, *, seed: int = 0) -> dict[str, Any]:
    """AdamW (wd 0) on `model` (consumed) with arm {"name", "lr", "batch_size", "max_iters", "time_s",
    "eval_every"}; batches as the ZO arms' (with replacement). Each step is one forward and one backward."""
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=arm["lr"], weight_decay=0.0)
    bs = arm["batch_size"]
    evals = [_eval_point(data, model, 0, 0, 0.0)]
    best_state, log, stop = _snapshot(model), [], "max_iters"
    for it in range(arm["max_iters"]):
        opt.zero_grad(set_to_none=True)
        loss = bucketed_ce(model, data.batch(seed, it, bs))[0]
        loss.backward()
        opt.step()
        log.append({"iteration": it + 1, "loss": float(loss.detach())})
        out_of_time, best_state = _after_iteration(data, model, arm, it, (it + 1) * bs, t0, evals, best_state)
        if out_of_time:
            stop = "time"
            break
    res = _finish({**arm, "method": "adamw-backprop"}, data, model, best_state, evals, t0, stop)
    res.update(iterations=len(log), seq_forwards=len(log) * bs, seq_backwards=len(log) * bs, log=log)
    return res


def paper_comparison(out_dir: Path, make_model: Callable[[torch.dtype], torch.nn.Module], data: PaperData, *,
                     total_s: float = 300.0, arms: tuple[str, ...] | None = None, seed: int = 0,
                     meta: dict | None = None, include: dict | None = None, resume: bool = False,
                     matmul: dict[str, str] | None = None, set_matmul: Callable[[str], None] | None = None,
                     weights: dict[str, float] | None = None, drift: bool = True,
                     iters_cap: int | None = None, end_by: float | None = None) -> dict[str, Any]:
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
    plan = paper_arms(total_s, arms, weights=weights)
    names_now = [a["name"] for a in plan]
    check_plan(names_now, include)
    inc = merge_include(include, names_now, resume)
    a1_moves = "A1" in names_now and "A1" not in inc["done"]
    if end_by is not None:
        a1_cap = min([a["max_iters"] for a in plan if a["name"] == "A1"] + [iters_cap or 10**9])
        tail = TAIL_S + (DRIFT_S_PER_STEP * a1_cap if drift and a1_moves else 0.0)
        total_s = min(total_s, end_by - time.time() - tail)
    results: dict[str, Any] = dict(inc["arms"])
    call = {"total_s": total_s, "arms": names_now, "fp32_matmul": matmul if set_matmul else "cpu",
            "included": sorted(inc["arms"]), "resumed": sorted(inc["resume"]), "iters_cap": iters_cap,
            "weights": weights}
    summary: dict[str, Any] = {"meta": {**(meta or {}), "total_s": total_s, "seed": seed, "regime": PAPER.__dict__,
                                        "n": {s: data.size(s) for s in ("train", "val", "test")},
                                        "calls": [*inc["calls"], call]},
                               "arms": results, "ledgers": dict(inc["ledgers"])}
    if inc["drift"] is not None:
        summary["drift"] = inc["drift"]
    skipped = dict.fromkeys(inc["done"], "finished in the included summary (kept)")

    def save() -> None:
        (out_dir / "paper_summary.json").write_text(json.dumps(summary, indent=2))

    def measure_drift() -> None:
        ledger = summary["ledgers"].get("A1")
        if not (drift and ledger and summary.get("drift", {}).get("steps") != len(ledger)):
            return
        t0 = time.perf_counter()
        m = make_model(torch.bfloat16)  # A2's numerics vs the fp32 master on A1's own steps, from bf16 weights
        blocks = canonical_blocks(m)
        summary["drift"] = {**numerics_drift([b.param.data for b in blocks], [b.offset for b in blocks], ledger),
                            "seconds": time.perf_counter() - t0}
        del m
        print(json.dumps({"drift": summary["drift"]}), flush=True)
        save()

    if not a1_moves:  # the ledger is final: measure now, inside the budget the arms share
        measure_drift()

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
        if cont is not None and arm.get("lr_from"):
            arm["lr"] = cont["lr"]  # a resumed A3w keeps its lr (A1's mean w may have moved since)
        elif arm.get("lr_from"):
            w = a1_mean_w(results)
            if w is None:
                skipped[arm["name"]] = "A1 logged no w"
                continue
            arm = dict(arm, lr=PAPER.lr * w)
        mode = (matmul or {}).get(arm["name"], "highest")
        arm["fp32_matmul"] = mode if set_matmul else "cpu"
        if cont is not None and cont.get("fp32_matmul") not in (None, arm["fp32_matmul"]):
            print(f"warning: {arm['name']} resumes with fp32 matmul {arm['fp32_matmul']} after "
                  f"{cont['fp32_matmul']}", flush=True)
        if set_matmul:
            set_matmul(mode)
        if arm.get("kind") == "backprop":
            r = run_backprop_arm(data, make_model(torch.float32), arm, seed=seed)
        else:
            dtype = torch.bfloat16 if arm["numerics"] == "inplace" else torch.float32
            r = run_zo_arm(data, make_model(dtype), arm, seed=seed, keep_ledger=bool(arm.get("keeps_ledger")),
                           resume=cont)
        if "ledger" in r:  # the step ledger, for the drift (A1) and for resuming in a later call
            summary["ledgers"][arm["name"]] = r.pop("ledger")
            if arm["name"] == "A1":
                summary.pop("drift", None)
        results[arm["name"]] = r
        print(json.dumps({k: r[k] for k in ("name", "iterations", "stop", "val_acc", "test_acc", "wall_s")}),
              flush=True)
        save()
    measure_drift()
    summary["arms"] = {n: results[n] for n in canonical_order(list(results))}
    summary["meta"]["skipped"] = skipped
    summary["table"] = summary_table(summary["arms"])
    save()
    plot_paper(summary, out_dir)
    return summary


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


def inplace_memory_scan(device: str = "cuda",
                        sizes: tuple[str, ...] = ("gpt-55b", "gpt-60b", "gpt-66b", "gpt-70b", "gpt-73b"),
                        seq_len: int = 1024) -> dict[str, Any]:
    """Largest GPT (batch 1 x seq_len) that takes two 1.5-SPSA(K=2) steps with bf16 weights perturbed and
    updated in place (2 bytes per parameter, no fp32 master), trying `sizes` in order until one runs out of
    memory. Returns {"gpu", "gpu_bytes", "trials": [{shape, params, ok, peak_bytes, seconds, error}], "largest"}.
    The default sizes bracket 8x AdamW's 6.7B on one H200 (53.6B): 55.2B, 60.0B, 65.7B, 69.8B, 73.4B (at the
    30B trial's 2.07 bytes per parameter, 69.8B needs ~144 GB of the 150 GB). ~10 s per trial.
    Raises RuntimeError without CUDA, ValueError for an unknown shape."""
    from benchmarks.headline import _build_shape
    from trainer.models.losses import lm_batch_loss

    shapes = {"gpt-13b": (40, 40, 5120), "gpt-30b": (48, 56, 7168), "gpt-45b": (56, 64, 8192),
              "gpt-55b": (68, 64, 8192), "gpt-60b": (74, 64, 8192), "gpt-66b": (64, 72, 9216),
              "gpt-70b": (68, 72, 9216), "gpt-73b": (72, 72, 9216)}
    if not torch.cuda.is_available():
        raise RuntimeError("the memory scan needs a CUDA GPU")
    bad = [s for s in sizes if s not in shapes]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {sorted(shapes)}")
    torch.zeros(1, device=device)
    trials, largest = [], None
    for name in sizes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        t0, model, err = time.perf_counter(), None, None
        try:
            model = _build_shape(*shapes[name], torch.bfloat16, device, seed=0)
            n = sum(p.numel() for p in model.parameters())
            x = torch.randint(0, 50257, (1, seq_len), device=device)
            st = ZOParamStepper(model, "1.5spsa", numerics="inplace", probes=2)
            for s in range(2):
                st.step(s, (x, x), lm_batch_loss, 1e-6, 1e-3)
            torch.cuda.synchronize(device)
            ok = True
            del st, x  # the stepper holds the weights: drop it, or the next shape starts with this one resident
        except torch.OutOfMemoryError as exc:
            ok, err = False, str(exc).splitlines()[0][:160]
            n = None
        peak = torch.cuda.max_memory_allocated(device)
        model = st = x = None  # noqa: F841 - release every reference before the next shape
        gc.collect()
        torch.cuda.empty_cache()
        trials.append({"shape": name, "params": n, "ok": ok, "peak_bytes": peak,
                       "seconds": time.perf_counter() - t0, "error": err})
        print(json.dumps(trials[-1]), flush=True)
        if not ok:
            break
        largest = name
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "gpu_bytes": props.total_memory, "batch": 1, "seq_len": seq_len,
            "trials": trials, "largest": largest}


def paper_main(out_dir: Path, *, device: str = "cuda", total_s: float = 300.0, arms: tuple[str, ...] | None = None,
               seed: int = 0, fp32_matmul: str | dict[str, str] = "highest", include: Path | None = None,
               resume: bool = False, weights: dict[str, float] | None = None, drift: bool = True,
               iters_cap: int | None = None, end_by: float | None = None) -> dict[str, Any]:
    """`bench zo --model smollm2 --regime paper`: SmolLM2-135M prompt classifier (trainer.prompt_classifier),
    loaded once and copied fresh for every arm (paper_comparison runs them).

    fp32_matmul: torch.set_float32_matmul_precision for the fp32 arms on CUDA, one mode for every arm or
    {arm: mode} (zo_paper_plan.parse_matmul): "highest" (true fp32, the default) or "high" (TF32, about 2x
    faster). At ε = 1e-4, h needs the loss to ~1e-8·|h|: TF32 (and bf16) forwards put rounding noise 10-100x
    larger than h into it (benchmarks/results/h200/zo-paper/RESULTS.md). include: an earlier call's
    paper_summary.json to merge (its arms kept unless re-run; its A1 serves A3w and the drift); resume,
    weights, drift, iters_cap, end_by: as paper_comparison.
    Raises ValueError for an unknown mode or arm, A3w without A1; FetchError / DataFetchError when weights or
    data are unavailable; OSError / json.JSONDecodeError for an unreadable include."""
    from benchmarks.zo import sentiment_task
    from trainer.prompt_classifier import load_smollm2_prompt_classifier

    names = [a["name"] for a in paper_arms(1.0, arms, weights=weights)]
    matmul = parse_matmul(fp32_matmul, names) if isinstance(fp32_matmul, str) else \
        {n: fp32_matmul.get(n, "highest") for n in names}
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
    return paper_comparison(out_dir, make_model, data, total_s=total_s, arms=arms, seed=seed, meta=meta,
                            include=inc, resume=resume, matmul=matmul, weights=weights, drift=drift,
                            set_matmul=torch.set_float32_matmul_precision if cuda else None, iters_cap=iters_cap,
                            end_by=end_by)


def padding_report(data: PaperData | None = None, iterations: int = 75, batch_size: int = PAPER.batch_size,
                   seed: int = 0) -> dict[str, Any]:
    """Tokens per forward of the paper's training batches, padded to the longest row vs length-bucketed
    (data.max_chunks / data.min_rows), averaged over batches 0..iterations-1 (CPU; no model). `data` defaults
    to the SmolLM2 splits from the cache. Returns {"train_mean_len", "train_max_len", "tokens_per_batch"
    {"real", "one_chunk", "bucketed"}, "one_chunk_over_real", "bucketed_over_real", "speedup_tokens"}."""
    from benchmarks.length_buckets import padded_tokens

    if data is None:
        from benchmarks.zo import sentiment_task

        data = PaperData.from_task(sentiment_task("smollm2", "cpu"))
    lens = data.lengths["train"]
    tot = {"real": 0, "one_chunk": 0, "bucketed": 0}
    for it in range(iterations):
        p = padded_tokens(lens[batch_rows(seed, it, lens.numel(), batch_size)], data.max_chunks, data.min_rows)
        for k in tot:
            tot[k] += p[k]
    per = {k: v / iterations for k, v in tot.items()}
    return {"train_mean_len": float(lens.float().mean()), "train_max_len": int(lens.max()),
            "tokens_per_batch": per, "one_chunk_over_real": per["one_chunk"] / per["real"],
            "bucketed_over_real": per["bucketed"] / per["real"], "speedup_tokens": per["one_chunk"] / per["bucketed"]}


@torch.no_grad()
def h_precision_check(model: torch.nn.Module, batch: Buckets | Split, seeds: list[int], eps_list=(1e-4, 1e-3),
                      repeats: int = 2) -> dict[str, Any]:
    """Is h = (L+ + L− − 2 L0)/ε² signal or forward-rounding noise at the paper's ε (`batch`: PaperData.batch
    chunks or one (ids, mask, labels))? For each ε: h of each Rademacher probe in `seeds` (out-of-place
    perturbation of the model's own dtype), and the spread of L0 over `repeats` identical forwards (its
    run-to-run noise). Returns {"dtype", "l0": [...], "by_eps": {eps: {"h": [...], "g": [...]}}}; the model is
    left unchanged."""
    from kernels import perturb_model

    def loss(m):
        return float(bucketed_ce(m, _as_buckets(batch))[0])
    blocks = canonical_blocks(model)
    params, offsets = [b.param.data for b in blocks], [b.offset for b in blocks]
    clean = [p.clone() for p in params]
    l0s = [loss(model) for _ in range(repeats)]
    out: dict[str, Any] = {"dtype": str(params[0].dtype), "l0": l0s, "by_eps": {}}
    for eps in eps_list:
        hs, gs = [], []
        for s in seeds:
            lpm = []
            for a in (eps, -eps):
                perturb_model(clean, offsets, s, a, "rademacher", outs=params)
                lpm.append(loss(model))
            for p, c in zip(params, clean):
                p.copy_(c)
            hs.append((lpm[0] + lpm[1] - 2 * l0s[0]) / eps ** 2)
            gs.append((lpm[0] - lpm[1]) / (2 * eps))
        out["by_eps"][str(eps)] = {"h": hs, "g": gs}
    return out
