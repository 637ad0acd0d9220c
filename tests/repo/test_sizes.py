"""The product's size limits, counted on its source with `ast`: no file over 450 lines, no function over 60 lines or
with 10 parameters or more outside the Triton kernels (probe_kernels/triton_kernels.py: a kernel's arguments are its
pointers, sizes and constexprs), and no more in-function imports of the product's own modules than now (most of those
left keep `sparecycles --help` and the control plane free of torch: tests/sparecycles/test_cli.py, tests/sparecycles/test_first_hour.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

PACKAGES = ("api", "coordinator", "probe_worker", "trainer", "wire", "fleet", "sparecycles", "benchmarks",
            "probe_kernels")
KERNELS = Path("probe_kernels/triton_kernels.py")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_PARAMS = 450, 60, 9
MAX_INNER_IMPORTS = 253  # in-function imports of the product's modules (relative ones included): lower it, never raise


def _sources() -> list[tuple[Path, str]]:
    return [(f.relative_to(ROOT), f.read_text()) for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))]


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller passes: positional, keyword-only, *args and **kwargs, less a method's self/cls."""
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return n - (1 if first and first[0].arg in ("self", "cls") else 0)


def _inner_imports(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Imports of the product's own modules anywhere inside `fn`, its nested functions' included."""
    count = 0
    for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom):
            count += node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
        elif isinstance(node, ast.Import):
            count += any(a.name.split(".")[0] in PACKAGES for a in node.names)
    return count


def _measure() -> dict[str, list]:
    found: dict[str, list] = {"files": [], "functions": [], "wide": [], "inner": []}
    for path, src in _sources():
        lines = src.count("\n")
        if lines > MAX_FILE_LINES:
            found["files"].append((str(path), lines))
        for fn in _functions(ast.parse(src)):
            length = fn.end_lineno - fn.lineno + 1
            where = f"{path}:{fn.lineno} {fn.name}"
            if length > MAX_FUNCTION_LINES and path != KERNELS:
                found["functions"].append((where, length))
            if _params(fn) > MAX_PARAMS and path != KERNELS:
                found["wide"].append(f"{path} {fn.name}")
            found["inner"] += [where] * _inner_imports(fn)
    return found


def test_no_file_over_450_lines():
    assert _measure()["files"] == []


def test_no_function_over_60_lines_outside_the_kernels():
    assert _measure()["functions"] == []


def test_no_function_of_10_parameters_outside_the_kernels():
    assert _measure()["wide"] == []


def test_in_function_imports_of_the_product_do_not_grow():
    inner = _measure()["inner"]
    assert len(inner) <= MAX_INNER_IMPORTS, f"{len(inner)} in-function project imports (at most {MAX_INNER_IMPORTS})"


def test_the_counts_see_what_they_count():
    """The walk finds the product (hundreds of files, the kernels' wide signatures) and each rule flags a case."""
    sources = _sources()
    assert len(sources) > 200 and any(p == KERNELS for p, _ in sources)
    kernels = ast.parse((ROOT / KERNELS).read_text())
    assert max(_params(fn) for fn in _functions(kernels)) >= 10  # the exemption is in use
    probe = ast.parse("def f(self, a, *b, c, **d):\n    from trainer import x\n    import json\n"
                      "    from .y import z\n" + "    pass\n" * 60)
    (fn,) = _functions(probe)
    assert _params(fn) == 4 and _inner_imports(fn) == 2 and fn.end_lineno - fn.lineno + 1 == 64
