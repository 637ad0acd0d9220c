"""tools/serving_demo.sh, the equivalent of an `up --serving vllm`: a real vLLM (read through /load), an open-loop
request load against it and `sparecycles up` whose worker yields to the engine. The load is answered, both runs
finish, and the worker's gate changed with the engine's load (it yielded to requests and took tasks again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probe_worker.engine import vllm_python

pytestmark = pytest.mark.slow  # a vLLM process and a whole `up` (~1.5 min)

ROOT = Path(__file__).resolve().parents[1]


def test_serving_demo_runs_up_beside_a_real_vllm_and_its_worker_yields(tmp_path):
    if not vllm_python().is_file():
        pytest.fail("no vLLM venv: run `bash tools/vllm.sh install` first")
    env = {**os.environ, "SPARECYCLES_PYTHON": sys.executable, "SERVING_LOGS": str(tmp_path / "logs"),
           "SERVING_REQUESTS": "20", "SERVING_RATE": "0.5", "SERVING_HOLD": "0.5"}
    run = subprocess.run(["bash", "tools/serving_demo.sh", "--steps", "6", "--workers", "1", "--run-dir",
                          str(tmp_path / "run"), "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["adamw"]["final_val_loss"] > 0 and summary["zocurv-line"]["final_val_loss"] > 0
    load = json.loads((tmp_path / "logs" / "load.json").read_text())
    assert len(load["requests"]) == 20 and not [r for r in load["requests"] if r["error"]]
    worker = (tmp_path / "run" / "logs" / "worker-0.log").read_text()
    assert "serving engine busy; yielding" in worker and "taking tasks again" in worker
