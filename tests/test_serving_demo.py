"""`sparecycles up --serving vllm`: a real vLLM (read through /load), an open-loop request load against it and `up`
whose worker yields to the engine. Every request is answered, both runs finish, the worker yielded to the requests
and took tasks again, and serving.json (and the summary) hold the load's latencies and the worker's figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probe_worker.engine import vllm_installed, vllm_python
from support.vllm import NO_VENV

pytestmark = pytest.mark.slow  # a vLLM process and a whole `up` (~2 min)

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 8  # at 0.5/s (seed 0) from the fleet-probed run's start: sent within ~16 s, before it ends


def test_up_serving_vllm_runs_beside_a_real_vllm_and_its_worker_yields(tmp_path):
    if not vllm_installed():
        pytest.skip(NO_VENV.format(venv=vllm_python().parent.parent))
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "sparecycles.cli", "up", "--serving", "vllm", "--serving-requests",
                          str(REQUESTS), "--serving-rate", "0.5", "--serving-hold", "0.5", "--steps", "12",
                          "--curvature-interval", "5", "--workers", "1", "--run-dir", str(out), "--no-progress"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("adamw", "zocurv-line"):
        assert math.isfinite(summary[name]["final_val_loss"]) and summary[name]["final_val_loss"] > 0
    # the step-5 round folded at step 10: the fleet-probed run used the worker's probes, so it left AdamW's path
    assert summary["fleet"]["results_accepted"] > 0 and not summary["warnings"]
    assert summary["zocurv-line"]["final_val_loss"] != summary["adamw"]["final_val_loss"]
    serving = json.loads((out / "serving.json").read_text())
    assert serving["requests_sent"] == serving["answered"] == REQUESTS and serving["failed"] == 0
    assert serving["requests_unsent"] == 0 and serving["load_ran_s"] > 0
    assert [r["error"] for r in serving["requests"]] == [""] * REQUESTS
    assert all(r["tokens"] >= 8 for r in serving["requests"])  # each streamed its 8-32 tokens
    assert 0 < serving["ttft_s"]["p50"] <= serving["ttft_s"]["p95"] <= serving["e2e_s"]["p95"]
    [worker] = serving["workers"]
    assert worker["name"] == "local-0" and worker["yielded_s"] > 0 and worker["engine_idle_s"] > 0
    assert worker["idle_used_s"] > 0 and worker["scrape_errors"] == 0
    assert summary["serving"]["answered"] == REQUESTS and "requests" not in summary["serving"]
    log = (out / "logs" / "worker-0.log").read_text()
    assert "serving engine busy; yielding" in log and "taking tasks again" in log
    assert "CPU priority" not in log  # --serving-nice 0: up's trainer shares these CPUs (a nice-19 worker starved)
    assert f"serving: {REQUESTS}/{REQUESTS} requests answered (0 failed)" in run.stderr
