"""One arm of the paper comparison (experiments.zo_paper.paper): a ZO arm (`run_zo_arm`, which can resume an earlier call's
arm from its step ledger) or the backprop AdamW arm (`run_backprop_arm`), each evaluated on validation every
`eval_every` iterations, stopped at its iteration cap or its time share, and scored once on test at the weights
validation selected."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from experiments.zo_paper.data import AccuracyLoss, PaperData, binomial_se
from experiments.zo_paper.length_buckets import bucketed_ce
from experiments.zo_paper.steps import PAPER, PlateauState, ZOParamStepper, plateau_update


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
    sel = _Selection(t0, evals, best_state, start, wall_before)
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
        if _after_iteration(data, model, arm, it, stepper.forward_passes * bs, sel):
            stop = "time"
            break
    fingerprint = stepper.fingerprint()  # of the last weights, before _finish loads the selected ones
    res = _finish(arm, data, model, sel.best_state, evals, t0, stop, wall_before)
    res.update(iterations=len(log), forward_passes=stepper.forward_passes,
               seq_forwards=stepper.forward_passes * bs, log=log, fingerprint=fingerprint)
    if resumed is not None:
        res["resumed"] = [*resume.get("resumed", []), resumed]
    if keep_ledger:
        res["ledger"] = ledger
    return res


@dataclass
class _Selection:
    """An arm's validation selection as it runs: its evaluations so far, the weights of the best (strict
    improvements: the earliest best, as `_finish` picks), this call's start (perf_counter `t0`, first iteration
    `start`) and `wall_before` seconds of earlier calls."""

    t0: float
    evals: list[dict]
    best_state: Any
    start: int = 0
    wall_before: float = 0.0


def _after_iteration(data: PaperData, model: torch.nn.Module, arm: dict, it: int, seq_forwards: int,
                     sel: _Selection) -> bool:
    """After iteration `it` (0-based; this call began at iteration sel.start): evaluate when due (every
    `eval_every`, the last iteration, or out of time), appending to sel.evals; snapshot the model into
    sel.best_state on a strict validation improvement. Out of time: another iteration at this call's mean pace
    (evaluations included) would end past `time_s` seconds from sel.t0, so an arm ends inside its share instead of
    one iteration after it. Eval wall_s adds sel.wall_before (earlier calls). Returns whether it is out of time."""
    spent = time.perf_counter() - sel.t0
    out_of_time = spent + spent / (it + 1 - sel.start) > arm["time_s"]
    if (it + 1) % arm["eval_every"] == 0 or out_of_time or it + 1 == arm["max_iters"]:
        e = _eval_point(data, model, it + 1, seq_forwards, sel.wall_before + time.perf_counter() - sel.t0)
        if e["val_acc"] > max(x["val_acc"] for x in sel.evals):
            sel.best_state = _snapshot(model)
        sel.evals.append(e)
    return out_of_time


def run_backprop_arm(data: PaperData, model: torch.nn.Module, arm: dict, *, seed: int = 0) -> dict[str, Any]:
    """AdamW (wd 0) on `model` (consumed) with arm {"name", "lr", "batch_size", "max_iters", "time_s",
    "eval_every"}; batches as the ZO arms' (with replacement). Each step is one forward and one backward."""
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=arm["lr"], weight_decay=0.0)
    bs = arm["batch_size"]
    evals = [_eval_point(data, model, 0, 0, 0.0)]
    sel, log, stop = _Selection(t0, evals, _snapshot(model)), [], "max_iters"
    for it in range(arm["max_iters"]):
        opt.zero_grad(set_to_none=True)
        loss = bucketed_ce(model, data.batch(seed, it, bs))[0]
        loss.backward()
        opt.step()
        log.append({"iteration": it + 1, "loss": float(loss.detach())})
        if _after_iteration(data, model, arm, it, (it + 1) * bs, sel):
            stop = "time"
            break
    res = _finish({**arm, "method": "adamw-backprop"}, data, model, sel.best_state, evals, t0, stop)
    res.update(iterations=len(log), seq_forwards=len(log) * bs, seq_backwards=len(log) * bs, log=log)
    return res
