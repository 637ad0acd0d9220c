"""Scoring, plot and report of the issue-17 fair comparison (experiments.zocurv_fair.fair runs it; protocol and
definitions in that module's docstring). Pure functions on run-result dicts (`load_result`), except
`load_result` / `plot` / `report` (files)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ADAMW = "adamw"


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


def variant_key(r: dict[str, Any]) -> str:
    """"optimizer@lr" plus "[k=v,…]" for the optimizer options of a run (result dict or asdict(FairRun));
    runs without the field (the first two calls) have none."""
    opts = ",".join(f"{k}={v}" for k, v in sorted((str(k), v) for k, v in r.get("options") or ()))
    return f"{r['optimizer']}@{r['lr']:g}" + (f"[{opts}]" if opts else "")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def finals_by_t(runs: list[dict[str, Any]]) -> tuple[dict[int, float], dict[int, list[float]]]:
    """({T: mean final val loss over seeds}, {T: per-seed finals in seed order}) of runs of one method."""
    per: dict[int, list[tuple[int, float]]] = {}
    for r in runs:
        per.setdefault(r["steps"], []).append((r["seed"], r["final_val_loss"]))
    seeds = {t: [v for _, v in sorted(xs)] for t, xs in sorted(per.items())}
    return {t: _mean(v) for t, v in seeds.items()}, seeds


def paired_gaps(runs: list[dict[str, Any]], adamw: list[dict[str, Any]]) -> dict[str, Any]:
    """Variant minus AdamW final val loss for each (T, seed) both ran (same seed: same init and batch order, so
    seed noise cancels): {"paired_gaps": {T: {seed: gap}}, "paired_gap_mean": mean over pairs (None if none)}."""
    ref = {(a["steps"], a["seed"]): a["final_val_loss"] for a in adamw}
    gaps: dict[int, dict[int, float]] = {}
    for r in sorted(runs, key=lambda r: (r["steps"], r["seed"])):
        if (r["steps"], r["seed"]) in ref:
            gaps.setdefault(r["steps"], {})[r["seed"]] = r["final_val_loss"] - ref[(r["steps"], r["seed"])]
    flat = [g for by_seed in gaps.values() for g in by_seed.values()]
    return {"paired_gaps": gaps, "paired_gap_mean": _mean(flat) if flat else None}


def _per_step(r: dict[str, Any], key: str) -> float:
    return r[key] / max(r["steps"], 1)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The target (best AdamW setting at T_ref = AdamW's longest T, mean over its seeds), AdamW's finals by T at
    that setting (and its own step ratio: the grid's resolution), and per variant (variant_key): finals by T
    (means over seeds), step ratio, the gap to AdamW at equal T (same setting; means, and paired by seed:
    `paired_gaps`), and wall ratios:
    at T_ref, trainer wall (probes elsewhere) over the best-setting AdamW run of the same call; at the
    reached T, step_ratio × (trainer s/step over the s/step of the same call's best-setting AdamW run nearest
    in T) — runs sharing one GPU slow each other, so only same-call runs are compared.
    Raises ValueError without a finished AdamW run."""
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
    best = min(settings, key=lambda k: _mean(settings[k]))
    target = _mean(settings[best])
    best_runs = [r for r in adam if key(r) == best]
    best_ref = min((r for r in best_runs if r["steps"] == t_ref), key=lambda r: r["seed"])
    adam_means, adam_seeds = finals_by_t(best_runs)
    out: dict[str, Any] = {"t_ref": t_ref, "target_val_loss": target, "adamw_seeds_at_best": len(settings[best]),
                           "adamw_finals_at_best": settings[best],
                           "best_adamw": {"lr": best[0], "warmup_frac": best[1]},
                           "adamw_grid": [{"lr": k[0], "warmup_frac": k[1], "final_val_loss": _mean(v),
                                           "seeds": len(v)} for k, v in sorted(settings.items())],
                           "adamw_bracketed": best[0] not in (min(k[0] for k in settings), max(k[0] for k in settings)),
                           "adamw_best_finals_by_T": adam_means, "adamw_best_finals_by_T_seeds": adam_seeds,
                           "adamw_step_ratio": step_ratio(adam_means, target, t_ref)["interp_ratio"],
                           "variants": {}}

    def same_call_adamw(r: dict[str, Any]) -> dict[str, Any] | None:
        same = [a for a in best_runs if a.get("plan") == r.get("plan")]
        return min(same, key=lambda a: (abs(a["steps"] - r["steps"]), a["seed"])) if same else None

    for vk in dict.fromkeys(variant_key(r) for r in results if r["optimizer"] != ADAMW):
        runs = [r for r in results if variant_key(r) == vk]
        means, seeds = finals_by_t(runs)
        entry = {"optimizer": runs[0]["optimizer"], "lr": runs[0]["lr"], "options": dict(runs[0].get("options") or ()),
                 "finals_by_T": means, "finals_by_T_seeds": seeds,
                 "gap_vs_adamw_same_T": {t: v - adam_means[t] for t, v in means.items() if t in adam_means},
                 **paired_gaps(runs, best_runs),
                 **step_ratio(means, target, t_ref)}
        ref = min((r for r in runs if r["steps"] == t_ref), key=lambda r: r["seed"], default=None)
        if ref is not None:
            wall_ref = same_call_adamw(ref) or best_ref
            entry.update({"final_at_T_ref": means[t_ref], "gap_at_T_ref": means[t_ref] - target,
                          "wall_reference": wall_ref["name"],
                          "wall_ratio_probes_elsewhere": ref["trainer_wall_s"] / wall_ref["wall_s"],
                          "probe_gpu_s": ref["probe_gpu_s"], "probe_forwards": ref["probe_forwards"],
                          "last_multipliers": ref["multipliers"][-1] if ref["multipliers"] else {}})
        hit = entry["reached_T"]
        if hit is not None:
            run = min((r for r in runs if r["steps"] == hit), key=lambda r: r["seed"])
            a = same_call_adamw(run)
            if a is not None:
                entry["wall_ratio_at_reached_T"] = (hit / t_ref) * _per_step(run, "trainer_wall_s") / _per_step(a, "wall_s")
                entry["wall_reference_at_reached_T"] = a["name"]
        out["variants"][vk] = entry
    return out


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: Path,
         partial: list[dict[str, Any]] = ()) -> None:
    """Left: validation curves of the T_ref runs (stopped runs dashed); right: final loss vs T per method (mean
    over seeds, each seed a dot; AdamW at its best setting), the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_ref = summary["t_ref"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5.2))
    curves = [r for r in sorted([*results, *partial], key=lambda r: r["name"])
              if r["steps"] == t_ref and len(r["val_curve"]) > 1]
    for i, r in enumerate(curves):
        s, v = zip(*r["val_curve"][1:])
        stop = f" (stopped at {r['steps_done']})" if r.get("partial") else ""
        a1.plot(s, v, marker=".", ls="--" if stop else "-", lw=1, color=plt.cm.tab20(i % 20),
                label=f"{variant_key(r)} wu {r['warmup_frac']:g} s{r['seed']}{stop}")
    best = tuple(summary["best_adamw"].values())
    methods = {f"adamw@{best[0]:g} (best)": [r for r in results if r["optimizer"] == ADAMW
                                            and (r["lr"], r["warmup_frac"]) == best]}
    for vk in summary["variants"]:
        methods[vk] = [r for r in results if r["optimizer"] != ADAMW and variant_key(r) == vk]
    for label, runs in methods.items():
        means, _ = finals_by_t(runs)
        (line,) = a2.plot(list(means), list(means.values()), marker="o", label=label)
        a2.scatter([r["steps"] for r in runs], [r["final_val_loss"] for r in runs], s=10, color=line.get_color())
    for ax in (a1, a2):
        ax.axhline(summary["target_val_loss"], ls="--", c="k", lw=0.8)
        ax.set_xlabel("optimizer step" if ax is a1 else "schedule length T (steps)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    a2.set_ylim(summary["target_val_loss"] - 0.1, summary["target_val_loss"] + 0.45)
    fig.suptitle(f"issue 17: AdamW vs ZO-Curv, full schedules, target = best AdamW(T={t_ref}) final (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_runs(folders: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run results from folders plus those of earlier fair_summary.json files ("runs" and "partial_runs"); a
    folder's result replaces an earlier one of the same (name, plan)."""
    seen = {(r["name"], r.get("plan")) for r in folders}
    out = list(folders)
    for summ in earlier:
        for r in [*summ.get("runs", []), *summ.get("partial_runs", [])]:
            if (r["name"], r.get("plan")) not in seen:
                seen.add((r["name"], r.get("plan")))
                out.append(r)
    return out


def report(out_dir: Path, run_dirs: list[Path] = (), include: list[Path] = ()) -> dict[str, Any]:
    """Summarise every finished run in the folders under out_dir and each of run_dirs, plus the runs kept in
    earlier summaries `include` (fair_summary.json of calls whose folders are gone); write
    out_dir/fair_summary.json and out_dir/fair_val_loss.png."""
    dirs = [d for root in (out_dir, *run_dirs) if root.is_dir() for d in sorted(root.iterdir()) if d.is_dir()]
    loaded = merge_runs([r for d in dirs if (r := load_result(d))],
                        [json.loads(Path(p).read_text()) for p in include])
    loaded.sort(key=lambda r: r["name"])
    results = [r for r in loaded if not r["partial"]]
    summary = summarize(results)
    summary["runs"] = results
    summary["partial_runs"] = [r for r in loaded if r["partial"]]  # stopped by the deadline: curves only
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fair_summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, summary, out_dir / "fair_val_loss.png", summary["partial_runs"])
    return summary
