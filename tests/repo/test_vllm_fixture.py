"""The serving tests' vLLM (support.vllm.SessionVllm, conftest's `vllm_engine`): without the vLLM venv a test skips
naming the prerequisite and how to get it; an engine that fails to start fails that test only, and the next test
tries again (nothing failed is kept for the rest of the session)."""

from __future__ import annotations

import pytest
from _pytest.outcomes import Failed, Skipped

from support.vllm import SessionVllm


def test_no_venv_skips_naming_the_install_and_an_engine_that_fails_is_retried(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPARECYCLES_CACHE", str(cache))  # tools/vllm.sh's venv: $SPARECYCLES_CACHE/vllm-venv
    holder = SessionVllm(tmp_path / "logs", model_dir=lambda: tmp_path / "no-such-model")
    with pytest.raises(Skipped, match=r"needs the vLLM venv \(bash tools/vllm\.sh install; .*--test-services"):
        holder.get()
    assert holder.starts == 0
    # The venv appears (installed meanwhile): the next test starts an engine. This one exits at once (its model
    # folder is missing: tools/vllm.sh start refuses it), so the test fails with the engine's own words...
    venv_bin = cache / "vllm-venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\nexit 3\n")
    (venv_bin / "python").chmod(0o755)
    (cache / "vllm-venv" / ".sparecycles-installed").write_text("pins\n")
    for attempt in (1, 2):  # ...and the test after it tries again instead of being handed the first failure
        with pytest.raises(Failed, match=r"(?s)vLLM exited \(2\).*no-such-model is not a model folder"):
            holder.get()
        assert holder.starts == attempt and holder.engine is None
