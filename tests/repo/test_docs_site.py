"""The documentation site (mkdocs.yml over docs/) builds with `mkdocs build --strict`: a broken link, a missing page
or a figure that is not there fails the build, and this test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT

MKDOCS = Path(sys.executable).parent / "mkdocs"  # the venv's (dev extra)


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(site)], cwd=root, capture_output=True,
                          text=True, timeout=300)


def test_the_site_builds_strictly_with_its_figures(tmp_path):
    res = _build(ROOT, tmp_path / "site")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # a figure of docs/RESULTS.md, next to its files under results/, is in the site and linked there
    assert (tmp_path / "site" / "_repo" / "experiments" / "kd" / "results" / "fleet" / "kd_curves.png").is_file()
    assert "_repo/experiments/kd/results/fleet/kd_curves.png" in (tmp_path / "site" / "RESULTS" /
                                                                       "index.html").read_text()


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    (root / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "mkdocs_hooks.py", root / "tools")
    shutil.copy(ROOT / "mkdocs.yml", root)
    shutil.copytree(ROOT / "results", root / "results")
    shutil.copytree(ROOT / "experiments", root / "experiments")
    shutil.copytree(ROOT / "examples", root / "examples")
    return root


def test_a_broken_link_or_a_missing_page_fails_the_build(tmp_path):
    root = _copy(tmp_path)
    page = root / "docs" / "fleet.md"
    page.write_text(page.read_text() + "\nSee [the missing page](nowhere.md) and ![a figure](../benchmarks/no.png).\n")
    res = _build(root, tmp_path / "site")
    assert res.returncode != 0 and "nowhere.md" in res.stderr and "no.png" in res.stderr, res.stderr[-3000:]
    page.write_text(page.read_text().split("\nSee [the missing page]")[0])
    (root / "docs" / "torchrun.md").unlink()  # in the nav, gone
    res = _build(root, tmp_path / "site")
    assert res.returncode != 0 and "torchrun.md" in res.stderr, res.stderr[-3000:]
