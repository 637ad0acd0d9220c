"""The fair AdamW vs ZO-Curv comparison of issue 17 (a benchmark, not a test).

Protocol (issue 17, "A fair comparison"): every run is a full schedule of its own length T — linear warmup
(5% or 10% of T), cosine to 0.1×peak at T, β = (0.9, 0.95), weight decay 0.1 (matrices), gradient clip
1.0 — and is scored by its validation loss at the end of that schedule (never at an intermediate point of
a longer one). AdamW's peak lr is bracketed on both sides. The target is AdamW(T_ref)'s final validation
loss at its best (lr, warmup) (mean over seeds when several ran there); a variant's step ratio is the
smallest T whose full schedule reaches the target, divided by T_ref (`step_ratio`; None when no T of the
grid reaches it), with a linear interpolation in T between the two bracketing grid points beside it.

Wall-clock: "trainer_wall_s" is the run's wall time minus the time its probes took (they would run on idle
workers); "probe_gpu_s" is that probe time. With several runs sharing one GPU both are inflated alike, so a
variant's wall ratio is taken against a best-setting AdamW run of the same plan (device call) when one ran.

Usage (one process per run, `jobs` at a time on one GPU, stopped at a deadline; `report` reads whatever
finished): `python -m benchmarks.zocurv_fair run --plan h200 --out DIR --jobs 6 --deadline-s 400`, then
`python -m benchmarks.zocurv_fair report DIR`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ADAMW = "adamw"


@dataclass(frozen=True)
class FairRun:
    """One full-schedule run of the comparison (name = its folder)."""

    optimizer: str
    lr: float
    steps: int
    warmup_frac: float = 0.1
    seed: int = 0
    plan: str = ""  # the plan (device call) that ran it: wall times compare only within one call

    @property
    def name(self) -> str:
        return f"{self.optimizer}-lr{self.lr:g}-T{self.steps}-wu{round(self.warmup_frac * 100)}-s{self.seed}"


def fair_config(spec: FairRun, *, model: str, corpus: str, batch_size: int, seq_len: int, device: str,
                run_dir: Path, eval_batches: int = 64, curvature_interval: int = 50, probe_budget: int = 151,
                probe_batch_size: int = 8, eps: float = 0.1):
    """The TrainConfig of `spec` under the issue-17 protocol (module docstring); eval every T/4 steps on the
    first `eval_batches`·batch_size held-out windows (trainer.data.iter_eval_batches: evenly spread).
    ZO defaults: a refresh every 50 steps with 151 forward-equivalents (DESIGN.md §2: one idle H200 buys ~3
    probe forwards per trainer step), probe batch 8 sequences, ε_G = 0.1·RMS(θ_G) (at 0.01 the fp32 loss
    rounding dominated h on gpt2-tiny: estimates flipped sign; 0.1 and 0.3 agreed)."""
    from trainer.config import TrainConfig

    return TrainConfig(model=model, corpus=corpus, optimizer=spec.optimizer, steps=spec.steps, batch_size=batch_size,
                       seq_len=seq_len, lr=spec.lr, min_lr=0.1 * spec.lr,
                       warmup_steps=max(1, round(spec.warmup_frac * spec.steps)), weight_decay=0.1, beta1=0.9,
                       beta2=0.95, grad_clip=1.0, eval_every=max(1, spec.steps // 4), eval_batches=eval_batches,
                       checkpoint_every=10 * spec.steps, seed=spec.seed, device=device, run_dir=run_dir,
                       curvature_interval=curvature_interval, probe_budget=probe_budget,
                       probe_batch_size=probe_batch_size, eps=eps)


# Reduced H200 plan (600 s of device time for the whole call): T_ref = 400 steps of 16×512.
H200_SETTINGS = {"model": "gpt2-small", "corpus": "classics", "batch_size": 16, "seq_len": 512}
VARIANTS = ("zocurv-group-fixed", "zocurv-group", "zocurv-global")


def h200_plan(t_ref: int = 400, variant_lr: float = 6e-4) -> list[FairRun]:
    """AdamW at T_ref: lr 3e-4 … 2e-3 at warmup 10%, two lrs at 5%; each variant at T ∈ {1, ½, ¾}·T_ref
    (the fixed table also at half the base lr: its multipliers reach 10×). In priority order: a deadline
    drops the last ones (T = ¾·T_ref first: ½ is the goal's point)."""
    specs = [FairRun(ADAMW, lr, t_ref, 0.1) for lr in (3e-4, 6e-4, 1.2e-3, 2e-3)]
    specs += [FairRun(ADAMW, lr, t_ref, 0.05) for lr in (6e-4, 1.2e-3)]
    specs += [FairRun(VARIANTS[0], variant_lr / 2, t_ref, 0.1)]
    for frac in (1.0, 0.5, 0.75):
        specs += [FairRun(v, variant_lr, round(frac * t_ref), 0.1) for v in VARIANTS]
    return specs


def h200_followup_plan() -> list[FairRun]:
    """Second call (the first ran out of its deadline after the 6 AdamW and 2 fixed-table runs): the learned
    variants at T_ref and a second AdamW seed at the best setting of the first call (lr 6e-4, warmup 10%)."""
    return [FairRun("zocurv-group", 6e-4, 400), FairRun("zocurv-global", 6e-4, 400), FairRun(ADAMW, 6e-4, 400, seed=1)]


def cpu_plan() -> list[FairRun]:
    """A smoke plan for gpt2-tiny on CPU (checks the harness end to end)."""
    return [FairRun(ADAMW, 3e-3, 4), FairRun(ADAMW, 1e-2, 4), FairRun("zocurv-group", 3e-3, 4),
            FairRun("zocurv-group", 3e-3, 2)]


PLANS = {"h200": (h200_plan, H200_SETTINGS), "h200-followup": (h200_followup_plan, H200_SETTINGS),
         "cpu": (cpu_plan, {"model": "gpt2-tiny", "corpus": "classics-small", "batch_size": 2, "seq_len": 16,
                            "eval_batches": 2, "curvature_interval": 2, "probe_budget": 11})}


# ---- scoring (pure) --------------------------------------------------------------------------------
def step_ratio(finals: dict[int, float], target: float, t_ref: int) -> dict[str, Any]:
    """Smallest T of `finals` ({T: final val loss}) with loss <= target, over t_ref; and the linear
    interpolation in T between the largest T above the target below it and the smallest T reaching it.
    Returns {"step_ratio", "interp_ratio", "reached_T"} (None where the grid does not reach the target)."""
    ts = sorted(finals)
    hit = next((t for t in ts if finals[t] <= target), None)
    interp = None
    if hit is not None:
        below = [t for t in ts if t < hit]
        if below:
            t0 = below[-1]
            l0, l1 = finals[t0], finals[hit]
            interp = (t0 + (hit - t0) * (l0 - target) / (l0 - l1)) / t_ref if l0 > l1 else hit / t_ref
        else:
            interp = hit / t_ref
    return {"step_ratio": hit / t_ref if hit is not None else None, "interp_ratio": interp, "reached_T": hit}


def load_result(run_dir: Path) -> dict[str, Any] | None:
    """Scores of one run folder (None without metrics): final val loss, val curve, wall and probe times, the
    logged multipliers; "partial": True when the run was stopped before its end (not scored)."""
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "spec.json").is_file():
        return None
    spec = json.loads((run_dir / "spec.json").read_text())
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    steps = [r for r in recs if "elapsed_s" in r]
    last = steps[-1] if steps else {}
    probe_s = float(last.get("probe_wall_s", 0.0))
    wall = float(last.get("elapsed_s", math.nan))
    mults = [{k: v for k, v in r.items() if k.startswith(("mult_", "snr_", "line_"))} | {"step": r["step"]}
             for r in steps if any(k.startswith("mult_") for k in r)]
    if not val or not steps:
        return None
    return {**spec, "name": run_dir.name, "partial": not (run_dir / "summary.json").is_file(),
            "steps_done": int(last.get("step", 0)), "final_val_loss": val[-1][1], "val_curve": val, "wall_s": wall,
            "probe_gpu_s": probe_s, "trainer_wall_s": wall - probe_s,
            "probe_forwards": float(last.get("probe_forwards", 0.0)), "multipliers": mults}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Best AdamW at T_ref (its longest T), the target, and each variant's finals by T and step ratio."""
    adam = [r for r in results if r["optimizer"] == ADAMW]
    if not adam:
        raise ValueError("no finished AdamW run: nothing to compare against")
    t_ref = max(r["steps"] for r in adam)
    at_ref = [r for r in adam if r["steps"] == t_ref]
    def key(r: dict[str, Any]) -> tuple[float, float]:
        return r["lr"], r["warmup_frac"]

    settings: dict[tuple, list[float]] = {}
    for r in at_ref:
        settings.setdefault(key(r), []).append(r["final_val_loss"])
    best = min(settings, key=lambda k: sum(settings[k]) / len(settings[k]))
    target = sum(settings[best]) / len(settings[best])
    best_run = min((r for r in at_ref if key(r) == best), key=lambda r: r["seed"])
    out: dict[str, Any] = {"t_ref": t_ref, "target_val_loss": target, "adamw_seeds_at_best": len(settings[best]),
                           "best_adamw": {"lr": best[0], "warmup_frac": best[1]},
                           "adamw_grid": [{"lr": k[0], "warmup_frac": k[1], "final_val_loss": sum(v) / len(v),
                                           "seeds": len(v)} for k, v in sorted(settings.items())],
                           "adamw_bracketed": best[0] not in (min(k[0] for k in settings), max(k[0] for k in settings)),
                           "variants": {}}
    for opt, lr in dict.fromkeys((r["optimizer"], r["lr"]) for r in results if r["optimizer"] != ADAMW):
        runs = [r for r in results if (r["optimizer"], r["lr"]) == (opt, lr)]
        finals = {r["steps"]: r["final_val_loss"] for r in runs}
        ref = next((r for r in runs if r["steps"] == t_ref), None)
        entry = {"optimizer": opt, "lr": lr, "finals_by_T": finals, **step_ratio(finals, target, t_ref)}
        if ref is not None:
            same = [r for r in at_ref if key(r) == best and r.get("plan") == ref.get("plan")]
            wall_ref = same[0] if same else best_run
            entry.update({"final_at_T_ref": ref["final_val_loss"], "gap_at_T_ref": ref["final_val_loss"] - target,
                          "wall_reference": wall_ref["name"],
                          "wall_ratio_probes_elsewhere": ref["trainer_wall_s"] / wall_ref["wall_s"],
                          "probe_gpu_s": ref["probe_gpu_s"], "probe_forwards": ref["probe_forwards"],
                          "last_multipliers": ref["multipliers"][-1] if ref["multipliers"] else {}})
        out["variants"][f"{opt}@{lr:g}"] = entry
    return out


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: Path,
         partial: list[dict[str, Any]] = ()) -> None:
    """Left: validation curves of the T_ref runs (stopped runs dashed); right: final loss vs T per method, the
    target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_ref = summary["t_ref"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in sorted([*results, *partial], key=lambda r: r["name"]):
        if r["steps"] == t_ref and len(r["val_curve"]) > 1:
            s, v = zip(*r["val_curve"][1:])
            stop = f" (stopped at {r['steps_done']})" if r.get("partial") else ""
            a1.plot(s, v, marker=".", ls="--" if stop else "-",
                    label=f"{r['optimizer']} lr {r['lr']:g} wu {r['warmup_frac']:g} s{r['seed']}{stop}")
    best = tuple(summary["best_adamw"].values())
    for opt, lr in dict.fromkeys((r["optimizer"], r["lr"]) for r in results):
        pts = sorted((r["steps"], r["final_val_loss"]) for r in results if (r["optimizer"], r["lr"]) == (opt, lr)
                     and (opt != ADAMW or (r["lr"], r["warmup_frac"]) == best))
        if pts:
            a2.plot(*zip(*pts), marker="o", label=f"{opt} lr {lr:g}")
    for ax in (a1, a2):
        ax.axhline(summary["target_val_loss"], ls="--", c="k", lw=0.8)
        ax.set_xlabel("optimizer step" if ax is a1 else "schedule length T (steps)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"issue 17: AdamW vs ZO-Curv, full schedules, target = best AdamW(T={t_ref}) final")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out_dir: Path) -> dict[str, Any]:
    """Summarise every finished run under out_dir; write fair_summary.json and fair_val_loss.png."""
    loaded = [r for d in sorted(p for p in out_dir.iterdir() if p.is_dir()) if (r := load_result(d))]
    results = [r for r in loaded if not r["partial"]]
    summary = summarize(results)
    summary["runs"] = results
    summary["partial_runs"] = [r for r in loaded if r["partial"]]  # stopped by the deadline: curves only
    (out_dir / "fair_summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, summary, out_dir / "fair_val_loss.png", summary["partial_runs"])
    return summary


# ---- running -----------------------------------------------------------------------------------------
def run_one(spec: FairRun, settings: dict[str, Any], device: str, out_dir: Path) -> None:
    """Train one spec into out_dir/spec.name (spec.json beside the run's files)."""
    from trainer.train import train

    run_dir = out_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(asdict(spec)))
    cfg = fair_config(spec, device=device, run_dir=run_dir, **settings)
    train(cfg, progress=False, overwrite=True, export=False)
    (run_dir / "checkpoint.safetensors").unlink(missing_ok=True)


def run_plan(plan: str, out_dir: Path, *, jobs: int, device: str, deadline_s: float) -> list[str]:
    """Run the plan's specs as subprocesses, `jobs` at a time; past the deadline stop what still runs.
    Returns the names of the runs that did not finish (no summary.json)."""
    queue = [replace(s, plan=plan) for s in PLANS[plan][0]()]
    out_dir.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + deadline_s
    running: list[tuple[subprocess.Popen, FairRun]] = []
    unfinished: list[str] = []
    while queue or running:
        while queue and len(running) < jobs and time.monotonic() < t_end:
            spec = queue.pop(0)
            log = (out_dir / f"{spec.name}.log").open("w")
            cmd = [sys.executable, "-m", "benchmarks.zocurv_fair", "one", json.dumps(asdict(spec)), plan,
                   str(out_dir), device]
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), spec))
        if time.monotonic() >= t_end:
            unfinished += [s.name for s in queue]
            queue.clear()
            for p, s in running:
                p.terminate()
                unfinished.append(s.name)
            for p, _ in running:
                p.wait(timeout=30)
            unfinished = [n for n in unfinished if not (out_dir / n / "summary.json").is_file()]
            break
        time.sleep(1.0)
        running = [(p, s) for p, s in running if p.poll() is None]
    return unfinished


def main(argv: list[str]) -> None:
    """CLI: `run --plan P --out DIR [--jobs J --device D --deadline-s S]`, `report DIR`, `one SPEC PLAN DIR DEV`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.zocurv_fair")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--plan", choices=sorted(PLANS), required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--jobs", type=int, default=4)
    r.add_argument("--device", default="cuda")
    r.add_argument("--deadline-s", type=float, default=400.0)
    rep = sub.add_parser("report")
    rep.add_argument("out", type=Path)
    one = sub.add_parser("one")
    for a in ("spec", "plan", "out", "device"):
        one.add_argument(a)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        left = run_plan(a.plan, a.out, jobs=a.jobs, device=a.device, deadline_s=a.deadline_s)
        print(json.dumps({"unfinished": left}))
    elif a.cmd == "report":
        s = report(a.out)
        print(json.dumps({k: v for k, v in s.items() if k != "runs"}, indent=1))
    else:
        run_one(FairRun(**json.loads(a.spec)), PLANS[a.plan][1], a.device, Path(a.out))


if __name__ == "__main__":
    main(sys.argv[1:])
