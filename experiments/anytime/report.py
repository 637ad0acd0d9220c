"""Tables and the curve plot of the anytime benchmark (experiments.anytime.bench): JSON -> results folder + README text.

`python -m experiments.anytime.report RUN/anytime.json --out experiments/anytime/results` copies the JSON, draws
`anytime.png` (raw and served validation loss over steps, the annealed references, and the anytime speedup)
and writes `table.md` (one row per evaluation, then the references against the served model at their step),
which is also printed for the README.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> Path:
    """Draw raw vs served validation loss, the annealed references and the speedup; write `path` (PNG)."""
    from experiments.plots import label_axes, pyplot, save

    plt = pyplot()
    evals = [e for e in result["evals"] if "served_val" in e]
    raw = [(e["step"], e["raw_val"]) for e in result["evals"] if e["step"] > 0]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    if raw:
        ax.plot(*zip(*raw, strict=True), "o-", ms=3, color="tab:blue", label="raw (WSD run)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["served_val"] for e in evals], "s--", ms=3, color="tab:red",
                label="served (anytime model)")
    refs = result.get("references", [])
    if refs:
        ax.plot([r["steps"] for r in refs], [r["val"] for r in refs], "k*", ms=11,
                label="AdamW annealed there (own WSD schedule)")
    lo = min([v for _, v in raw] + [e["served_val"] for e in evals] + [r["val"] for r in refs] or [0.0])
    # Top of the axis: everything but the first evaluation (the initial loss would flatten every curve), and every
    # annealed reference, so each star is on the plot.
    hi = max([v for _, v in raw[1:]] + [r["val"] for r in refs] or [1.0])
    ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi)
    s = result["settings"]
    label_axes(ax, "optimizer step", "validation loss (nats/token)",
          f"{s['preset']} {s['batch_size']}x{s['seq_len']} on {s['corpus']}, lr {s['lr']:g} WSD")
    sp = [(e["step"], e["speedup"]) for e in evals if e.get("speedup") is not None]
    lb = [(e["step"], e["speedup_lower_bound"]) for e in evals if e.get("speedup_lower_bound") is not None]
    if sp:
        ax2.plot(*zip(*sp, strict=True), "o-", color="tab:red", label="raw step reaching served / step")
    if lb:
        ax2.plot(*zip(*lb, strict=True), "^", color="tab:orange", label="lower bound (raw never reached it)")
    ax2.axhline(1.0, color="gray", lw=0.8)
    label_axes(ax2, "optimizer step", "anytime speedup")
    return save(fig, path)


def table(result: dict[str, Any]) -> str:
    """Markdown: per evaluation (step, lr, raw, served, winner, speedup, quadratic fit), then the references."""
    rows = ["| step | lr | raw val | served val | served − raw | winner | speedup | quad fit (resid; pred → meas) |",
            "| ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for e in result["evals"]:
        if "served_val" not in e:
            continue
        sp = (f"{e['speedup']:.2f}×" if e.get("speedup") is not None
              else f"> {e['speedup_lower_bound']:.2f}×" if e.get("speedup_lower_bound") else "–")
        if "quad_ok" not in e:
            quad = "–"
        elif e["quad_ok"]:
            quad = f"ok ({e['quad_resid']:.1e}; {e['quad_pred']:.4f} → {e['quad_meas']:.4f})"
        else:
            quad = f"refused ({e['quad_resid']:.1e})"
        rows.append(f"| {e['step']} | {e['lr']:.2e} | {e['raw_val']:.4f} | {e['served_val']:.4f} | "
                    f"{e['served_val'] - e['raw_val']:+.4f} | {e['served']} | {sp} | {quad} |")
    served_at = {e["step"]: e["served_val"] for e in result["evals"] if "served_val" in e}
    rows += ["", "| annealed at | its val (own WSD) | served at that step | served − annealed |",
             "| ---: | ---: | ---: | ---: |"]
    for r in result.get("references", []):
        sv = served_at.get(r["steps"])
        diff = f"{sv - r['val']:+.4f}" if sv is not None else "–"
        rows.append(f"| {r['steps']} ({r['frac']:g} T) | {r['val']:.4f} | "
                    f"{sv if sv is None else round(sv, 4)} | {diff} |")
    t = result.get("timing_s", {})
    rows += ["", f"{result.get('device')}, {result.get('date')}; wall {result.get('wall_s', 0):.0f} s (train "
             f"{t.get('train_s', 0):.0f} s, raw eval {t.get('eval_raw_s', 0):.0f} s, anytime "
             f"{t.get('anytime_s', 0):.0f} s, references {t.get('refs_s', 0):.0f} s); candidates scored "
             f"{result.get('scoring', '')}."]
    return "\n".join(rows)


def pull_line(plain: dict[str, Any], pulled: dict[str, Any]) -> str:
    """One sentence: the --pull run's final raw (and served) validation loss against the plain WSD run's at the
    same step, and how often it pulled."""
    last = pulled["evals"][-1]
    ref = next((e for e in plain["evals"] if e["step"] == last["step"]), None)
    n = sum(1 for e in pulled["evals"] if e.get("pulled"))
    if ref is None:
        return f"--pull: final raw {last['raw_val']:.4f} at step {last['step']} ({n} pulls); no plain evaluation there."
    return (f"--pull ablation: at step {last['step']} raw {last['raw_val']:.4f} (served {last.get('served_val', 0):.4f}) "
            f"vs the plain WSD run's raw {ref['raw_val']:.4f} (served {ref.get('served_val', 0):.4f}): "
            f"{last['raw_val'] - ref['raw_val']:+.4f} nats; {n} pulls.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=Path("experiments/anytime/results"))
    p.add_argument("--pull-json", type=Path, default=None, help="the --pull ablation's JSON (experiments/anytime/run.sh "
                   "STEPS pull), compared with the plain run at its last step")
    a = p.parse_args(argv)
    result = json.loads(a.json.read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    if a.json.resolve() != (a.out / "anytime.json").resolve():
        shutil.copyfile(a.json, a.out / "anytime.json")
    plot(result, a.out / "anytime.png")
    md = table(result)
    if a.pull_json is not None:
        pulled = json.loads(a.pull_json.read_text())
        shutil.copyfile(a.pull_json, a.out / "anytime_pull.json")
        md += "\n\n" + pull_line(result, pulled)
    (a.out / "table.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
