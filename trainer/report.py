"""Run reports: metrics JSON lines, loss-curve PNGs and (classifiers) accuracy-and-loss PNGs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a metrics JSON-lines file; a missing file gives an empty list, a torn last line is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


def plot_loss_curves(runs: dict[str, Iterable[dict[str, Any]]], path: Path, *, title: str) -> Path:
    """Plot train loss (EMA-smoothed, thin) and validation loss (markers) per run against step.

    Args:
        runs: label -> metric records; records with `loss` are train steps, with `val_loss` evaluations.
        path: PNG destination.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs.items()):
        recs = list(records)
        c = colors[i % len(colors)]
        _plot_losses(ax, recs, c, label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_losses(ax, recs: list[dict[str, Any]], color: str, label: str) -> None:
    """Train loss (EMA, thin) and validation loss (markers) of one run's records on `ax`."""
    tr = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if tr:
        ax.plot([s for s, _ in tr], _ema([v for _, v in tr]), color=color, alpha=0.45, lw=1.2,
                label=f"{label} train (EMA)")
    if va:
        ax.plot([s for s, _ in va], [v for _, v in va], color=color, marker="o", ms=4, lw=2,
                label=f"{label} validation")


def plot_accuracy_and_loss(runs: dict[str, Iterable[dict[str, Any]]], path: Path, *, title: str,
                           chance: float | None = None) -> Path:
    """Two panels against optimizer step, for classifier runs: validation accuracy (markers; a dotted line at
    `chance`, the accuracy of guessing, if given) and cross-entropy (train EMA thin, validation markers).

    Args:
        runs: label -> metric records (`loss` on train steps; `val_loss` and `val_acc` on evaluations).
        path: PNG destination. title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs.items()):
        recs = list(records)
        c = colors[i % len(colors)]
        acc = [(r["step"], r["val_acc"]) for r in recs if "val_acc" in r]
        if acc:
            acc_ax.plot([s for s, _ in acc], [100 * v for _, v in acc], color=c, marker="o", ms=4, lw=2, label=label)
        _plot_losses(loss_ax, recs, c, label)
    if chance is not None:
        acc_ax.axhline(100 * chance, color="gray", ls=":", lw=1.5, label="chance")
    acc_ax.set_ylabel("validation accuracy (%)")
    loss_ax.set_ylabel("cross-entropy (nats)")
    for ax in (acc_ax, loss_ax):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
