"""Run reports: metrics JSON lines, loss-curve PNGs and (classifiers) accuracy-and-loss PNGs.

Every loss panel shows each run's raw per-step train loss faintly, a bias-corrected EMA of it over the top
and the validation evaluations as markers joined by a line; a second loss panel zooms on the last third of
training, where the runs' final gap lives. Accuracy carries its binomial standard error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a metrics JSON-lines file, ordered by step (stable: a step's lines keep their order; an evaluation a
    fleet returned late is placed at its own step); a missing file gives an empty list, a torn last line is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(out, key=lambda r: r.get("step", 0))


def fleet_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """A fleet-probed run's figures at its last step, from the `fleet_<key>` record keys (fleet.attach's
    FleetFiguresMode: the coordinator's active workers, its tasks published and re-issued since it started, results
    by outcome, probes/s) and `peak_workers`, the most active workers any step saw; {} for a run without a fleet."""
    steps = [r for r in records if "fleet_workers" in r]
    if not steps:
        return {}
    out = {k.removeprefix("fleet_"): v for k, v in steps[-1].items() if k.startswith("fleet_")}
    return {**out, "peak_workers": max(r["fleet_workers"] for r in steps)}


def ema_beta(n: int) -> float:
    """Smoothing factor for `n` train points: 1 − 30/n within [0.5, 0.9], i.e. a window of about n/30 steps
    (5 for the 150-step demo, 10 from 300 steps on). An EMA lags a falling loss by about β/(1 − β) steps, so a
    short run gets a short window: its curve shows the descent, not the lag; the raw points stay visible."""
    return min(0.9, max(0.5, 1.0 - 30.0 / max(n, 1)))


def bias_corrected_ema(values: list[float], beta: float) -> list[float]:
    """EMA m_t = beta m_{t-1} + (1 - beta) v_t from m_0 = 0, divided by (1 - beta^t) (Adam's bias correction,
    Kingma & Ba 2015, section 3): every output is a weighted mean of the values so far, and the first
    value does not dominate the early curve as it does when the EMA starts at v_1. Pure function."""
    out, m = [], 0.0
    for t, v in enumerate(values, start=1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta**t) if beta > 0 else v)
    return out


def binomial_se(p: float, n: int) -> float:
    """Standard error sqrt(p (1 - p) / n) of an accuracy `p` (fraction) measured on `n` independent items."""
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def loss_unit(records: Iterable[dict[str, Any]]) -> str:
    """"nats/sentence" for classifier runs (their evaluations carry `val_acc`), else "nats/token"."""
    return "nats/sentence" if any("val_acc" in r for r in records) else "nats/token"


def _series(recs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in recs if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def _plot_losses(ax, recs: list[dict[str, Any]], color: str, label: str) -> list[tuple[list[int], list[float]]]:
    """Raw train loss (faint), its bias-corrected EMA and validation (markers + line) of one run on `ax`.
    Returns the smoothed series drawn (EMA, validation) for the zoom panel's y-range."""
    ts, tv = _series(recs, "loss")
    vs, vv = _series(recs, "val_loss")
    drawn = []
    if ts:
        ema = bias_corrected_ema(tv, ema_beta(len(tv)))
        ax.plot(ts, tv, color=color, alpha=0.18, lw=0.8)
        ax.plot(ts, ema, color=color, alpha=0.7, lw=1.3, label=f"{label} train (EMA)")
        drawn.append((ts, ema))
    if vs:
        ax.plot(vs, vv, color=color, marker="o", ms=5, lw=1.8, label=f"{label} validation (final {vv[-1]:.3f})")
        drawn.append((vs, vv))
    ss, sv = _series(recs, "served_val_loss")  # the anytime model (trainer.anytime), where the run has one
    if ss:
        ax.plot(ss, sv, color=color, marker="s", ms=4, lw=1.4, ls="--",
                label=f"{label} served (anytime; final {sv[-1]:.3f})")
        drawn.append((ss, sv))
    return drawn


def _zoom(ax, drawn: list[tuple[list[int], list[float]]], last_step: int) -> None:
    """Limit `ax` to the last third of training and to the smoothed curves' range there (10% margins)."""
    lo = last_step * 2 / 3
    ys = [y for xs, vals in drawn for x, y in zip(xs, vals) if x >= lo]
    ax.set_xlim(lo, last_step + max(1, last_step) * 0.02)
    if ys:
        span = (max(ys) - min(ys)) or abs(max(ys)) * 0.01 or 1.0
        ax.set_ylim(min(ys) - 0.1 * span, max(ys) + 0.1 * span)
    ax.set_title(f"last third (steps {math.ceil(lo)}–{last_step})", fontsize=10)


def _loss_panels(full, zoom, runs: dict[str, list[dict[str, Any]]], colors: list[str], unit: str) -> None:
    drawn, last = [], 0
    for i, (label, recs) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        for ax in (full, zoom):
            got = _plot_losses(ax, recs, c, label)
        drawn += got
        last = max([last] + [r["step"] for r in recs])
    full.axvspan(last * 2 / 3, last, color="gray", alpha=0.08, lw=0)  # the zoomed region
    full.set_title("whole run (shaded: zoomed at right)", fontsize=10)
    _zoom(zoom, drawn, last)
    for ax in (full, zoom):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"cross-entropy ({unit})")
        ax.grid(alpha=0.3)
    full.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # steps are whole numbers, also on a short zoom
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(runs: dict[str, Iterable[dict[str, Any]]], path: Path, *, title: str,
                     unit: str | None = None) -> Path:
    """Two panels against optimizer step: the whole run and a zoom on its last third. Per run: raw train loss
    (faint), its bias-corrected EMA, validation loss (markers and line, final value in the legend).

    Args:
        runs: label -> metric records; records with `loss` are train steps, with `val_loss` evaluations.
        path: PNG destination (parents created). title: figure title.
        unit: loss unit for the axis; default `loss_unit` of the records (nats/token, or nats/sentence).
    Returns `path`.
    """
    plt = _pyplot()
    runs = {k: list(v) for k, v in runs.items()}
    unit = unit or loss_unit(r for recs in runs.values() for r in recs)
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    _loss_panels(full, zoom, runs, plt.rcParams["axes.prop_cycle"].by_key()["color"], unit)
    fig.suptitle(title)
    return _save(fig, path)


def plot_accuracy_and_loss(runs: dict[str, Iterable[dict[str, Any]]], path: Path, *, title: str,
                           chance: float | None = None, n_val: int | None = None,
                           unit: str = "nats/sentence") -> Path:
    """Three panels against optimizer step, for classifier runs: validation accuracy (markers and line, with
    a band of ± one binomial standard error `binomial_se(p, n_val)` when `n_val` is given, and a dotted
    line at `chance`, the accuracy of guessing), then the loss panels of `plot_loss_curves`.

    Args:
        runs: label -> metric records (`loss` on train steps; `val_loss` and `val_acc` on evaluations).
        path: PNG destination. title: figure title.
        n_val: validation items each accuracy was measured on. unit: loss unit (mean per sentence).
    Returns `path`.
    """
    plt = _pyplot()
    runs = {k: list(v) for k, v in runs.items()}
    fig, (acc_ax, full, zoom) = plt.subplots(1, 3, figsize=(16, 4.8), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, recs) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        steps, acc = _series(recs, "val_acc")
        if not acc:
            continue
        acc_ax.plot(steps, [100 * a for a in acc], color=c, marker="o", ms=5, lw=1.8,
                    label=f"{label} (final {100 * acc[-1]:.1f}%)")
        if n_val:
            se = [100 * binomial_se(a, n_val) for a in acc]
            acc_ax.fill_between(steps, [100 * a - s for a, s in zip(acc, se)], [100 * a + s for a, s in zip(acc, se)],
                                color=c, alpha=0.15, lw=0)
    if chance is not None:
        acc_ax.axhline(100 * chance, color="gray", ls=":", lw=1.5, label="chance")
    band = f"; bands ±1 s.e., n = {n_val}" if n_val else ""
    acc_ax.set_title(f"validation accuracy{band}", fontsize=10)
    acc_ax.set_ylabel("validation accuracy (%)")
    acc_ax.set_xlabel("optimizer step")
    acc_ax.grid(alpha=0.3)
    acc_ax.legend(fontsize=8)
    _loss_panels(full, zoom, runs, colors, unit)
    fig.suptitle(title)
    return _save(fig, path)
