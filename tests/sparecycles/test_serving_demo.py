"""`sparecycles up --serving vllm`: a real vLLM (read through /load), an open-loop request load against it and `up`
whose worker yields to the engine. Every request is answered, both runs finish, the worker yielded to the requests
and took tasks again, and serving.json (and the summary) hold the load's latencies and the worker's figures."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from probe_worker.engine import vllm_installed, vllm_python
from sparecycles.up_serving import alone_count, serving_line
from support.paths import ROOT
from support.vllm import NO_VENV

pytestmark = pytest.mark.slow  # a vLLM process and a whole `up` (two 20-step runs)



def readme_command() -> list[str]:
    """The README's `sparecycles up --serving vllm ...` line (its comment dropped), as argv after `sparecycles`."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [line] = [x for x in readme.splitlines() if x.startswith("sparecycles up --serving vllm")]
    return shlex.split(line, comments=True)[1:]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.timeout(1800)  # on 2 cores under load ~20 it took over 15 min
def test_up_serving_vllm_as_the_readme_shows_it_serves_every_request_and_applies_rounds(tmp_path):
    """The README's command, as written (its run folder and --no-progress added): its load fits the fleet-probed run
    (every request sent and answered) and that run applies the workers' probe rounds."""
    if not vllm_installed():
        pytest.skip(NO_VENV.format(venv=vllm_python().parent.parent))
    args = readme_command()
    requests = int(_option(args, "--serving-requests"))
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "sparecycles.cli", *args, "--run-dir", str(out), "--no-progress"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("adamw", "zocurv-line"):
        assert math.isfinite(summary[name]["final_val_loss"]) and summary[name]["final_val_loss"] > 0
    # its rounds folded (no warning that the run is too short or that none came back): it left AdamW's path
    assert summary["fleet"]["results_accepted"] > 0 and not summary["warnings"], summary["warnings"]
    assert summary["zocurv-line"]["final_val_loss"] != summary["adamw"]["final_val_loss"]
    serving = json.loads((out / "serving.json").read_text())
    assert serving["requests_sent"] == serving["answered"] == requests and serving["failed"] == 0
    assert serving["requests_unsent"] == 0 and serving["load_ran_s"] > 0
    assert [r["error"] for r in serving["requests"]] == [""] * requests
    assert all(r["tokens"] >= 8 for r in serving["requests"])  # each streamed its 8-32 tokens
    assert 0 < serving["ttft_s"]["p50"] <= serving["ttft_s"]["p95"] <= serving["e2e_s"]["p95"]
    assert [w["name"] for w in serving["workers"]] == ["local-0", "local-1"]  # the README's 2 workers
    assert all(w["engine_idle_s"] > 0 and w["idle_used_s"] > 0 and w["scrape_errors"] == 0 for w in serving["workers"])
    assert sum(w["yielded_s"] for w in serving["workers"]) > 0
    # the engine alone first (a block of alone_count requests before any worker or trainer), then the ratio to it
    alone = serving["alone"]
    assert alone["requests_sent"] == alone["answered"] == len(serving["requests_alone"]) == alone_count(requests)
    assert 0 < alone["ttft_s"]["p95"] <= alone["e2e_s"]["p95"]
    ratio = serving["p95_vs_alone"]
    for key in ("ttft_s", "e2e_s"):
        assert math.isfinite(ratio[key]) and ratio[key] > 0
        assert ratio[key] == pytest.approx(serving[key]["p95"] / alone[key]["p95"])
    totals = serving["workers_total"]
    assert 0 < totals["idle_used_share"] <= 1
    assert totals["idle_used_share"] == pytest.approx(totals["idle_used_s"] / totals["engine_idle_s"])
    assert all(r["sent"] < serving["requests"][0]["sent"] for r in serving["requests_alone"])  # alone came first
    assert summary["serving"]["answered"] == requests and "requests" not in summary["serving"]
    assert "requests_alone" not in summary["serving"] and summary["serving"]["p95_vs_alone"] == ratio
    log = "".join((out / "logs" / f"worker-{i}.log").read_text() for i in range(2))
    assert "serving engine busy; yielding" in log and "taking tasks again" in log
    assert "CPU priority" not in log  # --serving-nice 0: up's trainer shares these CPUs (a nice-19 worker starved)
    assert f"serving: {requests}/{requests} requests answered (0 failed)" in run.stderr
    assert run.stdout.splitlines()[-2] == serving_line(summary["serving"])  # up's end: runs, serving, summary.json
