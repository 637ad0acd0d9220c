"""Scoring, tables and plot of issue 29's comparison (experiments.regime.plan runs it; protocol there).

Pure functions over run-result dicts (experiments.zocurv_fair.score.load_result: final val loss, curve, wall
and probe seconds, logged multipliers), except `report` / `plot` / `write_tables` (files).
`python -m experiments.regime.score tables SUMMARY.json OUT.md` turns a summary (e.g. the one an H200 call
returned) into the markdown tables of experiments/regime/results/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from experiments.zocurv_fair.score import finals_by_t, load_result, step_ratio

ADAMW = "adamw"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def arm_key(r: dict[str, Any]) -> str:
    """"optimizer[k=v]…@lr/schedule" of a run (result dict or asdict(RegimeRun))."""
    opts = "".join(f"[{k}={v}]" for k, v in sorted((str(k), v) for k, v in r.get("options") or ()))
    return f"{r['optimizer']}{opts}@{r['lr']:g}/{r.get('schedule', 'cosine')}"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Target = AdamW's best (lr, schedule) at T_ref (its longest T; chosen on the first seed), mean over seeds; per arm (arm_key): finals
    by T (mean, per seed), the step ratio (smallest T reaching the target ÷ T_ref, and interpolated), the seed
    spread where it reached, the gap at T_ref, probe GPU-seconds and forwards, trainer wall (probes elsewhere)
    over the same call's best-setting AdamW wall, the last logged multipliers. Raises ValueError without a
    finished AdamW run."""
    adam = [r for r in results if r["optimizer"] == ADAMW]
    if not adam:
        raise ValueError("no finished AdamW run: nothing to compare against")
    t_ref = max(r["steps"] for r in adam)
    grid: dict[tuple[float, str], list[float]] = {}
    for r in sorted(adam, key=lambda r: r["seed"]):
        if r["steps"] == t_ref:
            grid.setdefault((r["lr"], r.get("schedule", "cosine")), []).append(r["final_val_loss"])
    # The best setting is chosen on its first seed, as the plan chose it (experiments.regime.plan.best_adamw); the target
    # is the mean over every seed run there (the extra seeds were not used to choose).
    best = min(grid, key=lambda k: grid[k][0])
    target = _mean(grid[best])
    lrs = sorted({k[0] for k in grid if k[1] == best[1]})
    best_runs = [r for r in adam if (r["lr"], r.get("schedule", "cosine")) == best]
    out: dict[str, Any] = {
        "t_ref": t_ref, "target_val_loss": target, "best_adamw": {"lr": best[0], "schedule": best[1]},
        "adamw_finals_at_best": grid[best],
        "adamw_seed_spread": max(grid[best]) - min(grid[best]),
        "adamw_bracketed": lrs[0] < best[0] < lrs[-1],
        "adamw_grid": [{"lr": k[0], "schedule": k[1], "final_val_loss": _mean(v), "seeds": len(v)}
                       for k, v in sorted(grid.items())],
        "arms": {}}
    for key in dict.fromkeys(arm_key(r) for r in results if r["optimizer"] != ADAMW):
        out["arms"][key] = _arm(key, [r for r in results if arm_key(r) == key], target, t_ref, best_runs)
    return out


def _arm(key: str, runs: list[dict[str, Any]], target: float, t_ref: int,
         best_runs: list[dict[str, Any]]) -> dict[str, Any]:
    means, seeds = finals_by_t(runs)
    entry: dict[str, Any] = {"finals_by_T": means, "finals_by_T_seeds": seeds, **step_ratio(means, target, t_ref)}
    hit = entry["reached_T"]
    entry["seeds_at_reached_T"] = len(seeds[hit]) if hit is not None else 0
    entry["seed_spread_at_reached_T"] = (max(seeds[hit]) - min(seeds[hit])) if hit is not None else None
    ref = min((r for r in runs if r["steps"] == t_ref), key=lambda r: r["seed"], default=None)
    if ref is not None:
        same = [a for a in best_runs if a.get("plan") == ref.get("plan") and a["steps"] == t_ref] or best_runs
        wall_ref = min(same, key=lambda a: a["seed"])
        entry.update({"final_at_T_ref": means[t_ref], "gap_at_T_ref": means[t_ref] - target,
                      "probe_gpu_s": ref["probe_gpu_s"], "probe_forwards": ref["probe_forwards"],
                      "wall_ratio_probes_elsewhere": ref["trainer_wall_s"] / wall_ref["wall_s"],
                      "wall_reference": wall_ref["name"],
                      "last_multipliers": ref["multipliers"][-1] if ref["multipliers"] else {}})
    return entry


def _f(x: Any, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def tables(summary: dict[str, Any]) -> str:
    """Markdown: the AdamW grid, then one row per arm (ratio, seeds, gap, probe cost, multipliers). Pure."""
    lines = [f"T_ref = {summary['t_ref']}; target = AdamW {summary['best_adamw']['schedule']} lr "
             f"{summary['best_adamw']['lr']:g}, mean of {len(summary['adamw_finals_at_best'])} seed(s) = "
             f"**{summary['target_val_loss']:.4f}** (seed spread {summary['adamw_seed_spread']:.4f}; bracketed on "
             f"both sides: {summary['adamw_bracketed']})", "",
             "| AdamW lr | schedule | final val loss (mean) | seeds |", "| --- | --- | --- | --- |"]
    lines += [f"| {g['lr']:g} | {g['schedule']} | {g['final_val_loss']:.4f} | {g['seeds']} |"
              for g in summary["adamw_grid"]]
    lines += ["", "| arm | finals by T (mean) | step ratio | interp. | seeds at reached T (spread) | gap at T_ref | "
              "probe GPU-s | wall ratio (probes elsewhere) | last multipliers |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, a in summary["arms"].items():
        finals = ", ".join(f"{t}: {v:.4f}" for t, v in sorted(a["finals_by_T"].items(), key=lambda kv: -int(kv[0])))
        mult = ", ".join(f"{k[5:]} {v:.2f}" for k, v in a.get("last_multipliers", {}).items() if k.startswith("mult_"))
        spread = a["seed_spread_at_reached_T"]
        lines.append(f"| {key} | {finals} | {_f(a['step_ratio'], '.3f')} | {_f(a['interp_ratio'], '.3f')} | "
                     f"{a['seeds_at_reached_T']} ({_f(spread, '.4f')}) | {_f(a.get('gap_at_T_ref'), '+.4f')} | "
                     f"{_f(a.get('probe_gpu_s'), '.1f')} | {_f(a.get('wall_ratio_probes_elsewhere'), '.2f')} | {mult} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """Left: validation curves of the T_ref runs; middle: final loss vs T per arm and AdamW's best (target
    dashed); right: the logged per-role multipliers of the trust-region runs at T_ref."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_ref = summary["t_ref"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(18, 5.2))
    for i, r in enumerate(sorted((r for r in results if r["steps"] == t_ref), key=lambda r: r["name"])):
        s, v = zip(*r["val_curve"])
        a1.plot(s, v, marker=".", lw=1, color=plt.cm.tab20(i % 20), label=r["name"])
    best = summary["best_adamw"]
    groups = {f"adamw@{best['lr']:g}/{best['schedule']} (best)":
              [r for r in results if r["optimizer"] == ADAMW and (r["lr"], r.get("schedule", "cosine"))
               == (best["lr"], best["schedule"])]}
    groups |= {k: [r for r in results if r["optimizer"] != ADAMW and arm_key(r) == k] for k in summary["arms"]}
    for label, runs in groups.items():
        means, _ = finals_by_t(runs)
        (line,) = a2.plot(list(means), list(means.values()), marker="o", label=label)
        a2.scatter([r["steps"] for r in runs], [r["final_val_loss"] for r in runs], s=10, color=line.get_color())
    for r in results:
        if r["optimizer"] == "zocurv-trust" and r["steps"] == t_ref:
            for k in sorted({k for m in r["multipliers"] for k in m if k.startswith("mult_")}):
                pts = [(m["step"], m[k]) for m in r["multipliers"] if k in m]
                a3.plot(*zip(*pts), marker=".", lw=1, label=f"{arm_key(r)} s{r['seed']} {k[5:]}")
    for ax in (a1, a2):
        ax.axhline(summary["target_val_loss"], ls="--", c="k", lw=0.8)
        ax.set_ylabel("validation loss (nats/token)")
    a1.set_xlabel("optimizer step")
    a2.set_xlabel("schedule length T (steps)")
    a3.set_xlabel("optimizer step")
    a3.set_ylabel("lr multiplier")
    a3.set_yscale("log")
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5)
    fig.suptitle(f"issue 29: block-type lrs vs AdamW, full schedules; target = AdamW(T={t_ref}) mean (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out_dir: Path, more: list[Path] = ()) -> dict[str, Any]:
    """Summarise every finished run folder under out_dir and `more`; write regime_summary.json (the runs
    included), regime.png and regime_tables.md into out_dir."""
    dirs = [d for root in (out_dir, *more) if root.is_dir() for d in sorted(root.iterdir()) if d.is_dir()]
    loaded = [r for d in dirs if (r := load_result(d))]
    results = sorted((r for r in loaded if not r["partial"]), key=lambda r: r["name"])
    summary = summarize(results)
    summary["runs"] = results
    summary["partial_runs"] = [r["name"] for r in loaded if r["partial"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "regime_summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, summary, out_dir / "regime.png")
    (out_dir / "regime_tables.md").write_text(tables(summary))
    return summary


def main(argv: list[str]) -> None:
    """`tables SUMMARY.json OUT.md`: the markdown tables of a summary (written by `report`)."""
    if len(argv) != 3 or argv[0] != "tables":
        raise SystemExit("usage: python -m experiments.regime.score tables SUMMARY.json OUT.md")
    summary = json.loads(Path(argv[1]).read_text())
    Path(argv[2]).write_text(tables(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
