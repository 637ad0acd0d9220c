"""tools/vllm.sh fails loudly: a subcommand whose answer a caller substitutes (`start "$(bash tools/vllm.sh model)"
PORT`) exits non-zero with a message on stderr, never with an empty answer passed on as a path. Nothing here starts
vLLM (SPARECYCLES_CACHE points at an empty folder: no venv)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support.paths import ROOT


def _sh(*args: str, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "SPARECYCLES_CACHE": str(tmp / "cache"), **env}
    return subprocess.run(["bash", "-c", *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def test_model_without_the_projects_python_says_so_and_fails(tmp_path):
    res = _sh("bash tools/vllm.sh model", tmp=tmp_path, PYTHON=str(tmp_path / "no-venv" / "python"))
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.startswith(f"vllm.sh model: no python at {tmp_path / 'no-venv' / 'python'} (the project's venv")


def test_start_of_a_failed_model_stops_at_the_failing_step(tmp_path):
    """The README's line with `model` failing: two messages, each naming its step, and exit 2 (before: `model` exited
    127 and `start` got "")."""
    res = _sh('bash tools/vllm.sh start "$(bash tools/vllm.sh model)" 8100', tmp=tmp_path,
              PYTHON=str(tmp_path / "python"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"vllm.sh model: no python at {tmp_path / 'python'} (the project's venv: make {ROOT}/.venv as the README "
        "says, or set PYTHON=/path/to/its/python)",
        "vllm.sh start: the model folder is empty (did `bash tools/vllm.sh model` fail? its message is above)"]


@pytest.mark.parametrize(("args", "message"), [
    ("start", "usage: bash tools/vllm.sh start MODEL_DIR PORT [vLLM args...]"),
    ("start some-dir", "usage: bash tools/vllm.sh start MODEL_DIR PORT [vLLM args...]"),
    ("start {tmp} 8100", "vllm.sh start: {tmp} is not a model folder (no config.json there;"),
    ("start {tmp}/missing 8100", "vllm.sh start: {tmp}/missing is not a model folder (no config.json there;"),
    ("start {model} 8100", "no vLLM venv at {tmp}/cache/vllm-venv: run bash tools/vllm.sh install"),
    ("nope", "usage: bash tools/vllm.sh install|python|model|start"),
])
def test_start_checks_its_arguments_before_vllm(tmp_path, args, message):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    fill = {"tmp": tmp_path, "model": tmp_path / "model"}
    res = _sh(f"bash tools/vllm.sh {args.format(**fill)}", tmp=tmp_path)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.startswith(message.format(**fill)), res


def test_python_names_the_venv_even_before_install(tmp_path):
    """`python` answers the path, installed or not (probe_worker.engine.vllm_installed looks for the stamp beside
    it): never empty."""
    res = _sh("bash tools/vllm.sh python", tmp=tmp_path)
    assert (res.returncode, res.stdout) == (0, f"{tmp_path}/cache/vllm-venv/bin/python\n")
