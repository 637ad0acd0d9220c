"""The import layers of DESIGN.md section 3 hold: `lint-imports` (import-linter, contracts in pyproject.toml)
exits 0. Static: it reads the imports of every module, including the ones inside functions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT


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


def _stated_order(text: str) -> list[str]:
    """The layer order a document states as "`a` > `b` | `c` > ...": one entry per layer, siblings as "b | c"."""
    import re

    m = re.search(r"(`\w+`(?:\s*[>|]\s*`\w+`)+)", text)
    assert m, "no layer order of the form `a` > `b` | `c` found"
    return [" | ".join(re.findall(r"`(\w+)`", layer)) for layer in re.sub(r"\s+", " ", m.group(1)).split(">")]


def _contract(key: str, value: str) -> dict:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c[key] == value)


def test_the_documents_state_the_contracts_layers():
    """DESIGN.md (section 4) and development.md state the order the `layers` contract enforces, and every product
    root package is either in it or is `experiments`, which the `product-without-experiments` contract keeps out
    of every product package's imports: a layer added, dropped or swapped in one place and not the other fails."""
    import tomllib

    layers = _contract("id", "layers")["layers"]
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    stated = design[design.index("Imports flow down that order"):]
    assert _stated_order(stated) == layers
    dev = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert _stated_order(dev[dev.index("Imports flow down"):]) == layers
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    in_layers = {p.strip() for layer in layers for p in layer.split("|")}
    assert set(roots) - in_layers == {"experiments"}
    apart = _contract("id", "product-without-experiments")
    assert sorted(apart["source_modules"]) == sorted(in_layers) and apart["forbidden_modules"] == ["experiments"]


def test_the_layer_order_reader_reads_what_it_checks():
    """The reader above is not vacuous: a swapped order reads as swapped."""
    assert _stated_order("flow (`a` > `b` | `c` > `d`); more") == ["a", "b | c", "d"]
    assert _stated_order("`x` >\n`y`") == ["x", "y"]


def test_experiments_are_not_installed():
    """experiments/ stays out of the wheel: setuptools' find config names the product's packages only."""
    import tomllib
    from fnmatch import fnmatch

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not [p for p in find["include"] for m in ("experiments", "experiments.zo") if fnmatch(m, p)]
    assert (ROOT / "experiments" / "README.md").is_file()


def test_no_test_file_imports_another_test_file():
    """Shared helpers live in tests/support/ and shared fixtures in conftest.py: a test file importing another
    (`from test_kd import ...`) runs that file's module-level code and hides what it depends on."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert sorted(set(found)) == []

