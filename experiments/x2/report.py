"""Issue 21 on two GPUs (experiments/x2/run.sh): AdamW alone on GPU 0 vs zocurv-global on GPU 0 with its probes on
a worker on GPU 1 (`sparecycles up --gpus auto`); wall-clock to AdamW's final validation loss, fleet figures,
publish -> ready per version and GPU utilisation (a benchmark report, not a test).

Inputs: an `up` folder (`adamw/` and `zocurv-global/` run folders with metrics.jsonl and summary.json,
summary.json with the fleet figures, logs/worker-*.log), optionally an in-process run folder of the same
zocurv-global settings, and `nvidia-smi dmon -s u -o T -i N` logs per GPU.

Wall time: `elapsed_s` of a step record is seconds since the loop started, evaluations and checkpoints
included. `train_wall` removes them: the step right after an evaluation (or checkpoint) step took longer than
the median step by the evaluation's time, which is subtracted from every later step (pure function
`train_wall`). The wall-clock ratio is the trainer wall at which the run's validation curve (linear between
evaluations) first reaches AdamW's final validation loss, over AdamW's trainer wall at its end.

Usage: `python -m experiments.x2.report UP_DIR OUT_DIR [--inproc RUN_DIR] [--dmon GPU=PATH ...]`; the PNG again
from a summary: `python -m experiments.x2.report --plot-only OUT_DIR/x2_summary.json OUT_DIR`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from trainer.report import read_metrics

_READY = re.compile(r"run (\S+) version (\d+) ready in ([0-9.]+) s \(unix ([0-9.]+)\)")


def train_wall(records: list[dict[str, Any]]) -> dict[int, float]:
    """{step: seconds of training up to and including that step}, evaluation/checkpoint pauses removed.

    `records`: a run's metrics.jsonl (step records carry `elapsed_s`; evaluation records `val_loss`). Step 0
    (before the loop) is 0.0. Pure function.
    """
    steps = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r}
    if not steps:
        return {0: 0.0}
    order = sorted(steps)
    durs = {s: steps[s] - steps[p] for p, s in itertools.pairwise(order)}
    med = statistics.median(durs.values()) if durs else 0.0
    evals = {r["step"] for r in records if "val_loss" in r}
    out, removed = {0: 0.0}, 0.0
    for s in order:
        if s - 1 in evals and s in durs:  # this step's interval holds the evaluation after step s - 1
            removed += max(0.0, durs[s] - med)
        out[s] = steps[s] - removed
    return out


def val_curve(records: list[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """[(step, trainer wall s, raw elapsed s, val_loss)] of a run's evaluations, step 0 first."""
    wall = train_wall(records)
    raw = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r}
    raw[0] = 0.0
    return [(r["step"], wall.get(r["step"], float("nan")), raw.get(r["step"], float("nan")), r["val_loss"])
            for r in records if "val_loss" in r]


def time_to_reach(curve: list[tuple[int, float, float, float]], target: float,
                  col: int = 1) -> tuple[float | None, float | None]:
    """(wall seconds, step) at which the validation curve, linear between evaluations, first reaches `target`;
    (None, None) if it never does. `col`: 1 = trainer wall, 2 = raw elapsed. Pure function."""
    for (s0, *a), (s1, *b) in itertools.pairwise(curve):
        t0, l0, t1, l1 = a[col - 1], a[2], b[col - 1], b[2]
        if l1 <= target:
            f = 1.0 if l0 == l1 else (l0 - target) / (l0 - l1)
            f = min(max(f, 0.0), 1.0)
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return None, None


def publish_to_ready(records: list[dict[str, Any]], worker_logs: list[Path]) -> list[dict[str, float]]:
    """Per published version (`publish_version` of a step record): the publish call's time (`publish_s`) and
    publish start -> the first / last worker log line saying it is ready (seconds)."""
    ready: dict[int, list[float]] = {}
    for p in worker_logs:
        for m in _READY.finditer(p.read_text(errors="replace") if p.is_file() else ""):
            ready.setdefault(int(m.group(2)), []).append(float(m.group(4)))
    out = []
    for r in records:
        if "publish_unix" not in r:
            continue
        v = int(r["publish_version"])
        row = {"version": v, "publish_s": r["publish_s"], "logged_at_step": r["step"]}
        after = [t for t in ready.get(v, []) if t >= r["publish_unix"]]  # not an older run's version v
        if after:
            row["to_first_ready_s"] = min(after) - r["publish_unix"]
            row["to_all_ready_s"] = max(after) - r["publish_unix"]
        out.append(row)
    return out


def dmon_util(path: Path, windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Mean / max SM utilisation (%) of one GPU's `nvidia-smi dmon -s u -o DT` log inside each named window of
    unix times. Lines: date time gpu sm mem enc dec ...; '#' lines are headers."""
    rows = []
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        parts = line.split()
        if not parts or parts[0].startswith("#") or len(parts) < 4:
            continue
        try:
            t = time.mktime(time.strptime(f"{parts[0]} {parts[1]}", "%Y%m%d %H:%M:%S"))
            rows.append((t, float(parts[3]), float(parts[4]) if parts[4] != "-" else 0.0))
        except (ValueError, IndexError):
            continue
    out = {}
    for name, (a, b) in windows.items():
        sm = [u for t, u, _ in rows if a <= t <= b]
        mem = [m for t, _, m in rows if a <= t <= b]
        out[name] = {"sm_mean": statistics.fmean(sm) if sm else None, "sm_max": max(sm) if sm else None,
                     "mem_bw_mean": statistics.fmean(mem) if mem else None, "samples": len(sm)}
    return out


def run_window(run_dir: Path) -> tuple[float, float]:
    """(start, end) unix seconds of a run's training loop: its summary.json written at the end, minus its wall."""
    s = json.loads((run_dir / "summary.json").read_text())
    end = (run_dir / "summary.json").stat().st_mtime
    return end - float(s["wall_s_this_invocation"]), end


def report(up: Path, inproc: Path | None = None, dmon: dict[str, Path] | None = None) -> dict[str, Any]:
    """The figures of issue 21 from an `up` folder (module docstring)."""
    up_sum = json.loads((up / "summary.json").read_text()) if (up / "summary.json").is_file() else {}
    runs = {"adamw": up / "adamw", "zocurv-global (fleet)": up / "zocurv-global"}
    if inproc is not None:
        runs["zocurv-global (in process)"] = inproc
    recs = {k: read_metrics(p / "metrics.jsonl") for k, p in runs.items()}
    curves = {k: val_curve(v) for k, v in recs.items() if v}
    res: dict[str, Any] = {"curves": {k: [dict(zip(("step", "train_wall_s", "elapsed_s", "val_loss"), row))
                                          for row in c] for k, c in curves.items()}}
    if curves.get("adamw"):
        _, wall, raw, target = curves["adamw"][-1]
        res["target_val_loss"], res["adamw_wall_s"], res["adamw_elapsed_s"] = target, wall, raw
        for k, c in curves.items():
            t, s = time_to_reach(c, target)
            traw, _ = time_to_reach(c, target, col=2)
            res.setdefault("runs", {})[k] = {
                "final_val_loss": c[-1][3], "final_step": c[-1][0], "train_wall_s": c[-1][1], "elapsed_s": c[-1][2],
                "wall_to_target_s": t, "step_to_target": s,
                "wall_ratio": t / wall if t is not None else None,
                "elapsed_ratio": traw / raw if traw is not None else None,
                "probe_forwards": max((r.get("probe_forwards", 0.0) for r in recs[k]), default=0.0),
                "mult_global": [(r["step"], r["mult_global"]) for r in recs[k] if "line_ratio" in r],
                "line": {x: max((r.get(f"line_{x}", 0.0) for r in recs[k]), default=0.0)
                         for x in ("accepted", "stale", "duplicate", "dropped_rounds")},
                "summary": json.loads((runs[k] / "summary.json").read_text())
                if (runs[k] / "summary.json").is_file() else None}
    res["fleet"] = up_sum.get("fleet")
    res["publish_to_ready"] = publish_to_ready(recs.get("zocurv-global (fleet)", []),
                                               sorted((up / "logs").glob("worker-*.log")))
    if dmon:
        windows = {k: run_window(p) for k, p in runs.items() if (p / "summary.json").is_file()}
        res["gpu_util"] = {gpu: dmon_util(path, windows) for gpu, path in dmon.items()}
    res["up_summary"] = {k: v for k, v in up_sum.items() if k not in ("fleet",)}
    return res


def plot(res: dict[str, Any], path: Path) -> Path:
    """PNG: left, validation loss against trainer wall time (solid) and raw elapsed time (dotted) for every run;
    right, the same evaluations against steps, zoomed on the end. AdamW's final loss dashed in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for (name, rows), color in zip(res["curves"].items(), ("C0", "C3", "C2")):
        loss = [r["val_loss"] for r in rows]
        ax.plot([r["train_wall_s"] for r in rows], loss, marker=".", c=color, label=f"{name} (trainer wall)")
        ax.plot([r["elapsed_s"] for r in rows], loss, ls=":", c=color, lw=0.8, label=f"{name} (with evaluations)")
        ax2.plot([r["step"] for r in rows], loss, marker=".", c=color, label=name)
    finals = [r["val_loss"] for rows in res["curves"].values() for r in rows]
    for a in (ax, ax2):
        if "target_val_loss" in res:
            a.axhline(res["target_val_loss"], ls="--", c="k", lw=0.8, label="AdamW final")
        a.set_ylabel("validation loss (nats/token)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    if finals:
        lo = min(finals)
        ax.set_ylim(lo - 0.1, min(max(finals), lo + 2.5))
        ax2.set_ylim(lo - 0.05, lo + 0.6)
        ax2.set_xlim(left=max(0, max(r["step"] for rows in res["curves"].values() for r in rows) // 3))
    ax.set_xlabel("wall time of the training loop (s)")
    ax2.set_xlabel("step (last two thirds)")
    fig.suptitle("gpt2-small 16×512 on classics-small: AdamW (GPU 0) vs zocurv-global (GPU 0, probe worker on GPU 1)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI (module docstring): writes OUT_DIR/x2_summary.json and OUT_DIR/x2_val_loss_vs_wall.png."""
    ap = argparse.ArgumentParser(prog="python -m experiments.x2.report")
    ap.add_argument("up", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--inproc", type=Path)
    ap.add_argument("--dmon", nargs="*", default=[], help="GPU=PATH of an `nvidia-smi dmon -s u -o DT` log")
    ap.add_argument("--plot-only", action="store_true", help="UP is an x2_summary.json: only draw its PNG")
    a = ap.parse_args(argv)
    if a.plot_only:
        a.out.mkdir(parents=True, exist_ok=True)
        print(plot(json.loads(a.up.read_text()), a.out / "x2_val_loss_vs_wall.png"))
        return
    dmon = dict(x.split("=", 1) for x in a.dmon)
    res = report(a.up, a.inproc, {k: Path(v) for k, v in dmon.items()})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "x2_summary.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        plot(res, a.out / "x2_val_loss_vs_wall.png")
    except ImportError as exc:  # no matplotlib on the device: plot from the JSON afterwards
        print(f"no plot: {exc}")
    print(json.dumps({k: v for k, v in res.items() if k not in ("curves",)}, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
