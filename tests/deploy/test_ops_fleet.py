"""Monitoring as deployed: Debian's real `prometheus` scrapes a running `sparecycles up` through the scrape
configuration `up` writes (ops/prometheus.yml's jobs): every target (coordinator, trainer, each worker) is UP at
once, and every query of the Grafana dashboard returns data (a panel without any finite value fails).

One `up` (2 workers answering probe and teacher rounds: 12 short steps, 2 curvature rounds, teacher rounds for both runs
from a gpt2-tiny teacher exported with the project's tokenizer) serves every check; CI installs prometheus (.ci/run)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from support.paths import ROOT
from support.processes import processes_of, start_up

PROMETHEUS = shutil.which("prometheus")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (bootstrap.sh --test-services)")]


def _dashboard_queries() -> dict[str, str]:
    dash = json.loads((ROOT / "ops/grafana/dashboards/sparecycles.json").read_text())
    return {f"{p['title']} [{i}]": t["expr"] for p in dash["panels"] for i, t in enumerate(p["targets"])}


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _targets(api: str) -> list[dict]:
    try:
        return httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []  # prometheus still starting


@pytest.mark.timeout(900)
def test_prometheus_scrapes_up_and_every_dashboard_panel_has_data(tmp_path):
    from api.server import free_port
    from trainer.export import export_model, gpt2_tokenizer
    from trainer.models import build_model

    teacher = export_model(build_model("gpt2-tiny", seed=123), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    run_dir = tmp_path / "up"
    proc = start_up(run_dir, "--steps", "12", "--curvature-interval", "4", "--no-export", "--teacher", str(teacher))
    prom = None
    try:
        _wait_for(run_dir / "prometheus.yml", proc)
        cfg = yaml.safe_load((run_dir / "prometheus.yml").read_text())
        ops = yaml.safe_load((ROOT / "ops/prometheus.yml").read_text())
        jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
        assert set(jobs) == {j["job_name"] for j in ops["scrape_configs"]}  # the dashboard's jobs, as deployed
        assert len(jobs["coordinator"]) == len(jobs["trainer"]) == 1
        assert len(jobs["probe-worker"]) == 2  # the two workers answer probe and teacher rounds alike
        cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        cfg["rule_files"] = [str(ROOT / "ops/alerts.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        api = f"http://127.0.0.1:{port}/api/v1"
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start = time.time()
        all_up: list[dict] = []
        while proc.poll() is None:  # every target UP at the same time, while `up` runs
            targets = _targets(api)
            if len(targets) == 4 and all(t["health"] == "up" for t in targets):
                all_up = targets
                break
            time.sleep(0.5)
        out = proc.communicate(timeout=900)[0].decode()
        assert proc.returncode == 0, out[-3000:]
        assert "prometheus.yml" in out  # `up` says where its scrape configuration is
        assert all_up, f"not every target was up at once while `up` ran: {_targets(api)}"
        assert not (run_dir / "prometheus.yml").exists()  # its ports are closed: removed with the services
        end = time.time() + 2

        empty = []
        for name, expr in _dashboard_queries().items():
            r = httpx.get(f"{api}/query_range", params={"query": expr, "start": start, "end": end, "step": 1},
                          timeout=30).json()
            assert r["status"] == "success", (name, r)
            values = [float(v) for s in r["data"]["result"] for _, v in s["values"]]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{name}: {expr}")
        assert not empty, f"dashboard panels without data on a live `up`: {empty}"

        def peak(expr: str) -> float:
            r = httpx.get(f"{api}/query", params={"query": f"max_over_time(({expr})[10m:1s])", "time": end},
                          timeout=30).json()
            return max(float(s["value"][1]) for s in r["data"]["result"])

        assert peak('sum(sparecycles_workers{state="active"})') == 2
        assert peak('sum(rate(sparecycles_intake_results_total{outcome="accepted"}[1m]))') > 0
        assert peak("sum(sparecycles_worker_probes_evaluated_total)") > 0  # the workers' own /metrics
        assert peak('sparecycles_trainer_step{run="zocurv-line"}') == 12
        assert peak('sum(sparecycles_worker_teacher_tasks_total{outcome="done"})') >= 24  # 12 steps of each run
        summary = json.loads((run_dir / "summary.json").read_text())
        for name in ("adamw", "zocurv-line"):  # both runs distilled on every step (up waits for each step's targets)
            assert summary[name]["kd"]["kd_taken_steps"] == 12 and summary[name]["kd"]["kd_missing_steps"] == 0
        rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
        assert {r["health"] for g in rules for r in g["rules"]} == {"ok"}  # the alert rules evaluate on real data
    finally:
        if proc.poll() is None:
            proc.kill()
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
    assert processes_of(run_dir) == []
