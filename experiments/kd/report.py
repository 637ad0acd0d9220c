"""Issue 36's must-show from a `experiments/kd/run.sh run` folder: CE alone vs fleet-taught, steps to the same loss.

`python -m experiments.kd.report RUNS --out experiments/kd/results/fleet` reads RUNS/ce-N and every taught run
RUNS/NAME-N beside it (kd-N, or a variant's name from h200_kd.sh's KD_VARIANTS: the run folders of `train` at
horizon N steps: metrics.jsonl, summary.json), and writes:

- `kd_report.json`: per horizon and taught run (`variant`), CE-only's final validation loss, the step at which the taught run first reaches
  it (linear interpolation between the two evaluations that bracket it; None when it never does), that step over
  the horizon (the issue's goal: <= 0.6), both final losses, the teacher-round bytes per step over the wire (up:
  round messages; down: target blobs), kd steps taken and missing, and each run's time ledger per step;
- `kd_curves.png`: validation loss over steps, one panel per horizon (CE and every taught run);
- `table.md`, also printed, for the README.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def val_curve(run: Path) -> list[tuple[int, float]]:
    """(step, validation loss in nats/token) for each evaluation in `run`/metrics.jsonl, in step order.

    Raises FileNotFoundError without metrics.jsonl, ValueError when it holds no evaluation.
    """
    points = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            points.append((int(rec["step"]), float(rec["val_loss"])))
    if not points:
        raise ValueError(f"{run}/metrics.jsonl holds no validation loss")
    return sorted(points)


def step_reaching(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which `curve` (step, loss) falls to `target`, linearly interpolated between the two
    evaluations that bracket the crossing; None when no evaluation reaches it. A curve at or under `target` at its
    first evaluation reaches it there."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
        prev = (step, loss)
    return None


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _per_step(run: Path) -> dict[str, float] | None:
    """Each ledger phase's seconds per optimizer step from `run`/summary.json; None for a run cut before it ended
    (no summary)."""
    if not (run / "summary.json").is_file():
        return None
    summary = json.loads((run / "summary.json").read_text())
    steps = max(int(summary.get("steps", 0)) - int(summary.get("resumed_from_step") or 0), 1)
    return {k: v / steps for k, v in summary["time_ledger"]["phases_s"].items()}


def horizon(ce_dir: Path, kd_dir: Path) -> dict[str, Any]:
    """The must-show row for one horizon from its CE-only and taught run folders (see the module docstring). A
    taught run cut before its last step (no summary.json) counts up to its last logged step."""
    ce, kd = val_curve(ce_dir), val_curve(kd_dir)
    n = ce[-1][0]
    target = ce[-1][1]
    reach = step_reaching(kd, target)
    last = [r for r in _records(kd_dir) if "loss" in r][-1]  # kd counts so far, in every step's record
    ce_t, kd_t = _per_step(ce_dir), _per_step(kd_dir)
    return {
        "steps": n, "ce_final_val": target, "kd_final_val": kd[-1][1], "kd_last_eval_step": kd[-1][0],
        "kd_last_step": last["step"],
        "kd_step_reaching_ce_final": None if reach is None else round(reach, 1),
        "steps_ratio": None if reach is None else round(reach / n, 3),
        "kd_taken_steps": last.get("kd_taken_steps"), "kd_missing_steps": last.get("kd_missing_steps"),
        "bytes_up_per_step": round(last.get("kd_bytes_up", 0) / last["step"]),
        "bytes_down_per_step": round(last.get("kd_bytes_down", 0) / last["step"]),
        "ce_s_per_step": None if ce_t is None else {k: round(v, 5) for k, v in ce_t.items()},
        "kd_s_per_step": None if kd_t is None else {k: round(v, 5) for k, v in kd_t.items()},
        "step_time_ratio": (None if ce_t is None or kd_t is None
                            else round((kd_t["step"] + kd_t.get("kd", 0.0)) / ce_t["step"], 3)),
        "curves": {"ce": ce, "kd": kd},
    }


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Validation loss over steps, CE alone and each taught run, one panel per horizon; write `path` (PNG)."""
    from experiments.plots import label_axes, pyplot, save

    plt = pyplot()
    horizons = sorted({r["steps"] for r in rows})
    fig, axes = plt.subplots(1, len(horizons), figsize=(6.5 * len(horizons), 4.6), squeeze=False)
    colours = ["tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown"]
    for ax, n in zip(axes[0], horizons, strict=True):
        mine = [r for r in rows if r["steps"] == n]
        curves = [("CE alone", "tab:blue", mine[0]["curves"]["ce"])]
        curves += [(f"taught: {r.get('variant', 'kd')}", colours[i % len(colours)], r["curves"]["kd"])
                   for i, r in enumerate(mine)]
        for label, colour, curve in curves:
            ax.plot(*zip(*[(s, v) for s, v in curve if s > 0], strict=True), "-", color=colour, label=label)
        ax.axhline(mine[0]["ce_final_val"], color="gray", lw=0.8, ls="--")
        for i, r in enumerate(mine):
            if r["kd_step_reaching_ce_final"] is not None:
                ax.plot([r["kd_step_reaching_ce_final"]], [r["ce_final_val"]], "*", color=colours[i % len(colours)],
                        ms=12, label=f"{r.get('variant', 'kd')} reaches CE's final at {r['steps_ratio']:.3f}x")
        lo = min(v for _, _, curve in curves for s, v in curve)
        ax.set_ylim(lo - 0.1, lo + 2.5)
        label_axes(ax, "optimizer step", "validation loss (nats/token)", f"{n} steps")
    return save(fig, path)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per horizon and taught run."""
    out = ["| steps | taught run | CE final val | taught final val | taught reaches CE's final at | ratio "
           "| bytes/step up + down | kd missing | step time taught / CE |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        reach = "never" if r["kd_step_reaching_ce_final"] is None else f"{r['kd_step_reaching_ce_final']:.0f}"
        ratio = "–" if r["steps_ratio"] is None else f"{r['steps_ratio']:.3f}×"  # 0.605 is not 0.60
        final = f"{r['kd_final_val']:.4f}" + ("" if r["kd_last_eval_step"] == r["steps"]
                                               else f" (at step {r['kd_last_eval_step']}: cut)")
        time = "–" if r["step_time_ratio"] is None else f"{r['step_time_ratio']:.2f}×"
        out.append(f"| {r['steps']} | {r.get('variant', 'kd')} | {r['ce_final_val']:.4f} | {final} | {reach} | {ratio} | "
                   f"{r['bytes_up_per_step']:,} + {r['bytes_down_per_step']:,} | {r['kd_missing_steps']} | {time} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """CLI: RUNS folder -> kd_report.json, kd_curves.png and table.md under --out. Exit 2 when RUNS holds no
    ce-N with a taught NAME-N beside it."""
    p = argparse.ArgumentParser(prog="python -m experiments.kd.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, help="folder holding ce-N and taught NAME-N run folders (kd-N, ...)")
    p.add_argument("--out", type=Path, required=True, help="results folder (created)")
    a = p.parse_args(argv)
    horizons = sorted(int(d.name[3:]) for d in a.runs.glob("ce-*") if d.is_dir() and d.name[3:].isdigit()
                      and any(t.is_dir() and t != d for t in a.runs.glob(f"*-{d.name[3:]}")))
    if not horizons:
        print(f"error: {a.runs} holds no ce-N and kd-N (or NAME-N) run folders")
        return 2
    rows = [{"variant": d.name.rsplit("-", 1)[0], **horizon(a.runs / f"ce-{n}", d)} for n in horizons
            for d in sorted(a.runs.glob(f"*-{n}"), key=lambda d: (d.name != f"kd-{n}", d.name))
            if d.is_dir() and d.name != f"ce-{n}"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kd_report.json").write_text(json.dumps({"horizons": rows}, indent=1) + "\n")
    plot(rows, a.out / "kd_curves.png")
    md = table(rows)
    (a.out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
