"""Ops assets: every metric the dashboard and alert rules query is exported by the code; files parse."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
    coord.attach_live(lambda: {"active": 1}, lambda: {"run": 0})
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
