"""ruff finds nothing: the rule set and why each ignored rule is ignored are in pyproject.toml ([tool.ruff.lint])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


def test_ruff_reports_no_findings():
    exe = Path(sys.executable).parent / "ruff"  # the venv's ruff (dev extra)
    out = subprocess.run([str(exe), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
