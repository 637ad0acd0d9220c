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


def test_no_import_circle_in_trainer():
    """No module of trainer/ imports (directly or through others, function-level imports included) a module that
    imports it back: the registry (trainer.methods) builds the modes, which import neither it nor the config at
    run time. Imports under `if TYPE_CHECKING:` are annotations only and do not count."""
    import grimp

    graph = grimp.build_graph("trainer", exclude_type_checking_imports=False, cache_dir=None)
    circles = sorted((m, x) for m in graph.modules for x in graph.find_modules_directly_imported_by(m)
                     if x.startswith("trainer") and x != m and graph.chain_exists(importer=x, imported=m))
    assert circles == [], circles


def test_no_import_circle_anywhere():
    """No module of any project package imports (directly or through others, function-level and `if TYPE_CHECKING:`
    imports included) a module that imports it back: this walks grimp's graph, the one lint-imports builds, module
    by module across all root packages."""
    import tomllib

    import grimp

    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*roots, exclude_type_checking_imports=False, cache_dir=None)
    circles = sorted((m, x) for m in graph.modules for x in graph.find_modules_directly_imported_by(m)
                     if x.split(".")[0] in roots and x != m and graph.chain_exists(importer=x, imported=m))
    assert circles == [], f"import circles (module, imports, and back): {circles}"


def test_root_packages_are_ours_alone():
    """No installed distribution but sparecycles provides a top-level module named like one of our root packages,
    and none is a standard-library name: otherwise one shadows the other on sys.path. This is the kind of failure
    transformers 5.25 hit, when it started importing Hugging Face's `kernels` package and found this project's
    probe-kernel package (then named kernels/) instead."""
    import importlib.metadata
    import tomllib

    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    owners = importlib.metadata.packages_distributions()
    shared = {r: sorted(set(owners.get(r, [])) - {"sparecycles"}) for r in roots}
    assert {r: d for r, d in shared.items() if d} == {}, "root packages also provided by other distributions"
    assert sorted(set(roots) & set(sys.stdlib_module_names)) == []
    assert {"sparecycles"} <= set(owners.get("probe_kernels", [])), "the check must see this project's install"
