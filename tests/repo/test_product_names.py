"""The installed product names no issue, past run or machine model: no module of an installed package is named
after one (`h200_s5`, `_gpu_session`, `issue46`) and no module docstring says "issue N", H100 or H200. Those belong
to experiments/ (not installed) and docs/RESULTS.md, which say when and where a figure was measured. Static: reads
pyproject.toml's package list and each module's docstring, imports nothing."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from support.paths import ROOT

MODULE_NAME = re.compile(r"issue|h[12]00|session|_s\d+$|gpu\d+", re.I)
DOCSTRING = re.compile(r"\bissues? \d+|\bh[12]00\b", re.I)


def _installed_modules() -> list[Path]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = sorted({p.split("*")[0].rstrip(".") for p in include})
    return [f for top in tops for f in sorted((ROOT / top).rglob("*.py"))]


def test_no_installed_module_is_named_after_an_issue_run_or_machine():
    mods = _installed_modules()
    assert len(mods) > 100 and not any("experiments" in f.parts for f in mods)
    named = [str(f.relative_to(ROOT)) for f in mods if MODULE_NAME.search(f.stem)]
    assert named == []


def test_no_installed_module_docstring_names_an_issue_or_machine():
    said = {str(f.relative_to(ROOT)) for f in _installed_modules()
            if DOCSTRING.search(ast.get_docstring(ast.parse(f.read_text(encoding="utf-8"))) or "")}
    assert said == set()


def test_the_patterns_catch_what_they_name():
    assert MODULE_NAME.search("h200_s5") and MODULE_NAME.search("_gpu_session") and MODULE_NAME.search("issue46")
    assert not MODULE_NAME.search("serving_load") and not MODULE_NAME.search("shards")
    assert DOCSTRING.search("Teacher runs (issue 47)") and DOCSTRING.search("on an H200 host")
    assert not DOCSTRING.search("see the issues list") and not DOCSTRING.search("h2000 steps")
