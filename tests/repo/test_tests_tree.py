"""The tests mirror the package tree, and every test file the repository names exists.

- Each test file lies in tests/<folder>/, where <folder> is an installed package (pyproject.toml's list),
  `experiments` (its drivers), `repo` (repository-wide checks) or `deploy` (images, compose, ops, tools scripts);
  none lies in tests/ itself, no folder of tests/ but support/ is a package (no __init__.py), so every basename is
  unique (pytest's default `prepend` import mode imports a test file by its basename).
- Every `tests/....py` path that a tracked file names (docs, READMEs, comments, docstrings, scripts, test code)
  exists, so a moved or renamed test cannot leave a stale pointer behind. results/ is left out: its logs and
  records are what ran at the commit they name, paths included.

- Every collected test has a node id of its own (pytest-xdist runs a node id once).

Reads files and runs `git ls-files`; the last check runs `pytest --collect-only`."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from collections import Counter

from support.paths import ROOT, TESTS

OWN_FOLDERS = {"experiments", "repo", "deploy"}
# A path under tests/ ending in .py (a glob's `*` allowed), not part of a longer path or word.
TEST_PATH = re.compile(r"(?<![\w/.-])tests/[\w/*.-]*?\w\*?\.py\b")


def _packages() -> set[str]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.split("*")[0].rstrip(".") for p in include}


def _test_files() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def test_each_test_file_lies_in_the_folder_of_what_it_tests():
    allowed = _packages() | OWN_FOLDERS
    files = _test_files()
    assert len(files) > 100
    misplaced = [str(f.relative_to(TESTS)) for f in files
                 if len(f.relative_to(TESTS).parts) != 2 or f.parent.name not in allowed]
    assert misplaced == []
    assert sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted({f.parent.name for f in files} | {"support"}), "a folder of tests/ without tests, or a stray one"


def test_test_basenames_are_unique_and_no_test_folder_is_a_package():
    twice = [name for name, n in Counter(f.name for f in _test_files()).items() if n > 1]
    assert twice == []
    packages = [str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")]
    assert packages == ["support/__init__.py"]


def _tracked_text_files() -> list:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        import pytest

        pytest.skip("needs a git checkout (git ls-files) to know which files are the repository's")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = []
    for name in names.decode().split("\0"):
        if not name or name.startswith("results/"):
            continue
        path = ROOT / name
        try:
            out.append((name, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # a binary (figures, archives), or deleted in the work tree and not yet committed
    return out


def test_every_named_test_path_exists():
    files = _tracked_text_files()
    assert len(files) > 300
    stale = sorted({f"{name}: {m}" for name, text in files for m in TEST_PATH.findall(text)
                    if not (any(ROOT.glob(m)) if "*" in m else (ROOT / m).is_file())})
    assert stale == [], "paths under tests/ that do not exist (moved or renamed: update them)"


def test_the_path_pattern_finds_what_it_names():
    text = ("see tests/trainer/test_train.py::test_x, `tests/probe_worker/test_engine_teacher*.py` and "
            "(tests/support/paths.py); not mytests/a.py nor docs/tests/b.py")
    assert TEST_PATH.findall(text) == ["tests/trainer/test_train.py", "tests/probe_worker/test_engine_teacher*.py",
                                       "tests/support/paths.py"]


def test_every_collected_test_has_a_node_id_of_its_own():
    """pytest-xdist (the README's test command) schedules by node id: a test generated under another's id runs once
    for all of them (schemathesis' `schema.parametrize()` gave 31 operations one id)."""
    import sys

    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert res.returncode == 0 and len(ids) > 1000, res.stdout[-2000:] + res.stderr[-2000:]
    assert [i for i, n in Counter(ids).items() if n > 1] == []
