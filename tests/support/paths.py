"""Where the tests find the checkout: ROOT, the repository's root, from this file's own place (tests/support/), so a
test reads the same files whichever folder of tests/ holds it (tests/<package>/ mirrors the package tree)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


# Files whose tests share the session's one vLLM (the vllm_session fixture) or start another beside it: under
# pytest-xdist (.ci/run's `-n 2 --dist loadgroup`) they run on one worker, so the run starts one engine, not one per
# worker, and two engines never share the machine's cores.
ENGINE_FILES = frozenset({
    "probe_worker/test_engine_teacher.py", "probe_worker/test_serving_engine.py",
    "probe_worker/test_engine_teacher_worker.py", "probe_worker/test_serving_yield.py", "repo/test_vllm_fixture.py",
    "benchmarks/test_serving_llamacpp.py", "sparecycles/test_serving_demo.py",
})
