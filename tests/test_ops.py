"""Ops assets: every metric the dashboard and alert rules query is exported by the code; files parse."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bsparecycles_[a-z0-9_]+")


def _queried() -> set[str]:
    dash = json.loads((ROOT / "ops/grafana/dashboards/sparecycles.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((ROOT / "ops/alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return {m for e in exprs for m in NAME.findall(e)}


def _exported() -> set[str]:
    from coordinator.metrics import CoordinatorMetrics
    from probe_worker.metrics import WorkerMetrics
    from trainer import metrics as trainer_metrics

    coord = CoordinatorMetrics()
    coord.attach_live(lambda: {"active": 1}, lambda: {"run": 0}, lambda: {"run": 0})
    worker_reg = CollectorRegistry()
    WorkerMetrics(registry=worker_reg)
    trainer_metrics.record("adamw", {"step": 1, "loss": 2.0, "clipped_frac": 0.0}, 8)
    trainer_metrics.record("adamw", {"step": 1, "val_loss": 2.0}, 8)
    from prometheus_client import REGISTRY

    text = b"".join(generate_latest(r) for r in (coord.registry, worker_reg, REGISTRY)).decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names


def test_every_queried_metric_is_exported():
    queried, exported = _queried(), _exported()
    assert len(queried) >= 8
    missing = queried - exported
    assert not missing, f"dashboard/alerts query metrics no code exports: {sorted(missing)}"


def test_compose_and_prometheus_config_parse():
    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    assert {"redis", "coordinator", "trainer", "probe-worker", "prometheus", "grafana"} <= set(compose["services"])
    redis_cmd = compose["services"]["redis"]["command"]
    assert "noeviction" in redis_cmd and "--appendonly yes" in redis_cmd and "--requirepass" in redis_cmd
    prom = yaml.safe_load((ROOT / "ops/prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"coordinator", "trainer", "probe-worker"}


# ---- live tools (CI installs Debian's prometheus and docker-compose; see .ci/run) -----------------------

PROMETHEUS = shutil.which("prometheus")
COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (.ci/run installs Debian's package)")
def test_docker_compose_config_validates(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / "docker/.env.example").read_text())
    res = subprocess.run([COMPOSE, "-f", str(ROOT / "docker/compose.yml"), "--env-file", str(env_file), "config"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "noeviction" in res.stdout and "probe-worker" in res.stdout
    # Without the secrets the file refuses to render instead of starting with blanks.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    res = subprocess.run([COMPOSE, "-f", str(ROOT / "docker/compose.yml"), "--env-file", str(empty), "config"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_")})
    assert res.returncode != 0 and "SPARECYCLES_" in res.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (.ci/run installs Debian's package)")
def test_prometheus_scrapes_a_live_coordinator(tmp_path):
    from api.server import free_port
    from support.coordinator import running_env

    gen = running_env(tmp_path)
    env = next(gen)
    try:
        env.enroll("scraped")  # one active worker: sparecycles_workers{state="active"} == 1
        host_port = env.url.removeprefix("http://")
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global: {scrape_interval: 1s}\n"
            f"rule_files: [{ROOT / 'ops/alerts.yml'}]\n"
            "scrape_configs:\n"
            f"  - job_name: coordinator\n    static_configs: [{{targets: ['{host_port}']}}]\n"
        )
        port = free_port()
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            value, deadline = None, time.monotonic() + 60
            while value is None and time.monotonic() < deadline:
                time.sleep(1)
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                                  params={"query": 'sum(sparecycles_workers{state="active"})'}, timeout=5)
                except httpx.HTTPError:
                    continue
                result = r.json().get("data", {}).get("result", [])
                value = float(result[0]["value"][1]) if result else None
            assert value == 1.0
            rules = httpx.get(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5).json()
            names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
            assert {"NoLiveProbeWorkers", "WorkerQuarantined"} <= names  # the alert rules load
        finally:
            prom.terminate()
            prom.wait(timeout=30)
    finally:
        gen.close()


def _reads(command: list[str]) -> set[str]:
    """The SPARECYCLES_* variables the `sparecycles` subcommand in `command` reads: its options' env vars, the
    pydantic-settings fields it builds, the cache/runs roots every command reads, and `$${NAME}` in a shell line."""
    import re

    import typer.main

    from coordinator.settings import CoordinatorSettings
    from fleet.attach import FleetSettings
    from sparecycles.cli import app

    line = " ".join(command)
    sub = re.search(r"\b(coordinator|train|worker)\b", line.split("sparecycles", 1)[-1] if "sparecycles" in line
                    else line).group(1)
    click_cmd = typer.main.get_command(app).commands[sub]
    names = {"SPARECYCLES_CACHE", "SPARECYCLES_RUNS"}  # trainer/paths.py, coordinator/settings.py
    for p in click_cmd.params:
        envvars = p.envvar if isinstance(p.envvar, list | tuple) else [p.envvar] if p.envvar else []
        names.update(envvars)
    settings = {"coordinator": CoordinatorSettings, "train": FleetSettings}.get(sub)
    if settings is not None:
        names.update(f"SPARECYCLES_{f.upper()}" for f in settings.model_fields)
    names.update(re.findall(r"\$\$?\{(SPARECYCLES_[A-Z_]+)", line))
    return names


def test_compose_passes_only_variables_its_programs_read():
    """A deployment file is code: every SPARECYCLES_* variable a service gets is read by the program it runs
    (a variable nobody reads is a setting that silently does nothing, like the trainer's coordinator URL was)."""
    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    checked = 0
    for name in ("coordinator", "trainer", "probe-worker"):
        svc = compose["services"][name]
        passed = {k for k in (svc.get("environment") or {}) if k.startswith("SPARECYCLES_")}
        unread = passed - _reads(svc["command"])
        assert not unread, f"compose passes {sorted(unread)} to {name}, which never reads them"
        checked += len(passed)
    assert checked >= 8
    trainer = " ".join(compose["services"]["trainer"]["command"])
    assert "--coordinator http://coordinator:8000" in trainer  # the compose trainer probes on the fleet
    assert compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
