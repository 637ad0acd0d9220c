"""The benchmarks' matplotlib steps in one place: a headless pyplot, a panel's labels, a figure written and closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(ax: Any, xlabel: str, ylabel: str, title: str | None = None, legend: float = 8) -> None:
    """One panel's axis labels, title (fontsize 10), light grid and legend (fontsize `legend`)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)


def save(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lay `fig` out tightly, write it to `path` (PNG at `dpi`), close it; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
