"""The import layers of DESIGN.md section 3 hold: `lint-imports` (import-linter, contracts in pyproject.toml)
exits 0. Static: it reads the imports of every module, including the ones inside functions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = Path(sys.executable).parent / "lint-imports"  # the venv's console script (dev extra)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's packages, not another editable install
    out = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
