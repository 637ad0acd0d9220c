"""Where the tests find the checkout: ROOT, the repository's root, from this file's own place (tests/support/), so a
test reads the same files whichever folder of tests/ holds it (tests/<package>/ mirrors the package tree)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
