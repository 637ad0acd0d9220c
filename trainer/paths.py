"""Filesystem locations shared by every package (cache, run folders)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Return the cache root (created if missing).

    `SPARECYCLES_CACHE` overrides the default `~/.cache/sparecycles`. Downloads, tokenized corpora and
    converted weights live here so a second run downloads nothing.
    """
    root = Path(os.environ.get("SPARECYCLES_CACHE") or Path.home() / ".cache" / "sparecycles")
    root.mkdir(parents=True, exist_ok=True)
    return root


def runs_dir() -> Path:
    """Return the default parent folder of run folders: env `SPARECYCLES_RUNS` or `./runs`."""
    root = Path(os.environ.get("SPARECYCLES_RUNS") or Path.cwd() / "runs")
    root.mkdir(parents=True, exist_ok=True)
    return root
