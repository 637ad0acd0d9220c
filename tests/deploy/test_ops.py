"""Ops assets: every metric the dashboard and alert rules query is exported by the code; files parse."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from support.paths import ROOT

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
    from probe_worker.teacher import TeacherMetrics
    from trainer import metrics as trainer_metrics

    coord = CoordinatorMetrics()
    coord.attach_live(lambda: {"active": 1}, lambda: {"run": 0}, lambda: {"run": 0}, lambda: {"run": 1.0})
    worker_reg = CollectorRegistry()
    WorkerMetrics(registry=worker_reg)
    TeacherMetrics(registry=worker_reg)
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


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (tools/bootstrap.sh --test-services)")
def test_docker_compose_config_validates(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / "docker/.env.example").read_text())
    res = subprocess.run([COMPOSE, "-f", str(ROOT / "docker/compose.yml"), "--env-file", str(env_file), "config"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "noeviction" in res.stdout and "probe-worker" in res.stdout
    res = subprocess.run([COMPOSE, "-f", str(ROOT / "docker/compose.yml"), "--env-file", str(env_file), "--profile",
                          "serving", "config"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "serving-worker" in res.stdout and "http://engine:8001/load" in res.stdout
    # Without the secrets the file refuses to render instead of starting with blanks.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    res = subprocess.run([COMPOSE, "-f", str(ROOT / "docker/compose.yml"), "--env-file", str(empty), "config"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_")})
    assert res.returncode != 0 and "SPARECYCLES_" in res.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (tools/bootstrap.sh --test-services)")
def test_prometheus_scrapes_a_live_coordinator(tmp_path):
    from api.server import free_port
    from support.coordinator import running_env

    # one active worker: sparecycles_workers{state="active"} == 1 until its lease ends (it never heartbeats), longer
    # than the wait below (the default 30 s lease let a Prometheus slow to start on a loaded machine scrape 0)
    gen = running_env(tmp_path, lease_seconds=600.0)
    env = next(gen)
    try:
        env.enroll("scraped")
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
            value, deadline = None, time.monotonic() + 180  # a liveness bound only
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
    (a variable nobody reads is a setting that silently does nothing, like the trainer's coordinator URL was).
    Both compose files: the GPU fleet and the CPU one (docker/compose.cpu.yml, two named workers)."""
    for path, services in (("docker/compose.yml", ("coordinator", "trainer", "probe-worker", "serving-worker")),
                           ("docker/compose.cpu.yml", ("coordinator", "trainer", "probe-worker-1", "probe-worker-2"))):
        compose = yaml.safe_load((ROOT / path).read_text())
        checked = 0
        for name in services:
            svc = compose["services"][name]
            passed = {k for k in (svc.get("environment") or {}) if k.startswith("SPARECYCLES_")}
            unread = passed - _reads(svc["command"])
            assert not unread, f"{path} passes {sorted(unread)} to {name}, which never reads them"
            checked += len(passed)
        assert checked >= 8, path
    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    trainer = " ".join(compose["services"]["trainer"]["command"])
    assert "--coordinator http://coordinator:8000" in trainer  # the compose trainer probes on the fleet
    assert compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_the_serving_profile_shares_one_gpu_and_wires_the_engines_load_to_the_worker():
    """compose.yml's `--profile serving`: a vLLM engine and a worker on the same GPU; the worker reads the engine's
    /load (counted from a request's arrival: --enable-server-load-tracking) at the engine's own port, with options
    `sparecycles worker` has; the engine leaves the worker part of the GPU's memory, as .env.example says."""
    from urllib.parse import urlsplit

    import typer.main

    from sparecycles.cli import app

    svcs = yaml.safe_load((ROOT / "docker/compose.yml").read_text())["services"]
    engine, worker = svcs["engine"], svcs["serving-worker"]
    assert engine["profiles"] == worker["profiles"] == ["serving"]
    for svc in (engine, worker):
        assert svc["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    eng, wrk = _options(engine["command"]), _options(worker["command"])
    assert "--enable-server-load-tracking" in engine["command"]
    url = urlsplit(wrk["--serving-metrics"])
    assert (url.hostname, url.port, url.path) == ("engine", int(eng["--port"]), "/load")
    assert engine["ports"] == [f"{eng['--port']}:{eng['--port']}"] and worker["depends_on"]["engine"] == {
        "condition": "service_healthy"}
    assert f":{eng['--port']}/health" in " ".join(engine["healthcheck"]["test"])
    known = {o for p in typer.main.get_command(app).commands["worker"].params for o in p.opts}
    assert set(wrk) <= known, set(wrk) - known
    default = float(re.fullmatch(r"\$\{SPARECYCLES_ENGINE_GPU_MEMORY:-([0-9.]+)\}", eng["--gpu-memory-utilization"])[1])
    example = dict(line.split("=", 1) for line in (ROOT / "docker/.env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert 0 < default < 1 and float(example["SPARECYCLES_ENGINE_GPU_MEMORY"]) == default


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (bootstrap.sh --test-services)")
def test_promtool_exercises_every_alert_rule():
    """ops/alerts_test.yml gives each alert of ops/alerts.yml a fixture on which it fires (and a time before which
    it must not): promtool evaluates the real rules on them."""
    rules = yaml.safe_load((ROOT / "ops/alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    cases = yaml.safe_load((ROOT / "ops/alerts_test.yml").read_text())["tests"]
    checks = [c for t in cases for c in t["alert_rule_test"]]
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == alerts  # each alert fires on a fixture
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == alerts  # and is quiet where it must be
    res = subprocess.run([PROMTOOL, "test", "rules", str(ROOT / "ops/alerts_test.yml")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def _options(command: list[str]) -> dict[str, str]:
    """`--name value` pairs of a compose command (a list, or ["sh", "-c", "exec sparecycles ..."])."""
    words = " ".join(command).split()
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


def _image_dirs(dockerfile: str) -> set[str]:
    """Directories the image creates (mkdir -p) AND hands to uid 10001 (chown -R sparecycles), which it runs as."""
    text = (ROOT / dockerfile).read_text()
    assert re.search(r"useradd .*--uid 10001 sparecycles", text) and "\nUSER sparecycles" in text, dockerfile
    made = {p for m in re.finditer(r"mkdir -p ([^&\n]+)", text) for p in m.group(1).split()}
    owned = {p for m in re.finditer(r"chown -R sparecycles ([^&\n]+)", text) for p in m.group(1).split()}
    return made & owned


def test_compose_ports_and_volumes_match_what_programs_use():
    """Every port a service listens on is the one its program binds (its own options), the one Prometheus scrapes,
    the one others call; every volume is mounted where the program reads or writes (its options and SPARECYCLES_*
    paths), the shared blob volume is the same directory for all three, and every directory a program writes
    exists in its image owned by the user it runs as (a named volume starts as a copy of it)."""
    import typer.main

    from sparecycles.cli import app

    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    svcs = compose["services"]
    prom = {j["job_name"]: j for j in yaml.safe_load((ROOT / "ops/prometheus.yml").read_text())["scrape_configs"]}
    opts = {name: _options(svcs[name]["command"]) for name in ("coordinator", "trainer", "probe-worker")}
    cli = typer.main.get_command(app).commands
    for name, sub in (("coordinator", "coordinator"), ("trainer", "train"), ("probe-worker", "worker")):
        known = {o for p in cli[sub].params for o in p.opts}
        assert set(opts[name]) <= known, f"{name} passes options `sparecycles {sub}` lacks: {set(opts[name]) - known}"

    # Ports: the coordinator's, published, health-checked, scraped and called by the others.
    port = opts["coordinator"]["--port"]
    assert opts["coordinator"]["--host"] == "0.0.0.0" and svcs["coordinator"]["ports"] == [f"{port}:{port}"]
    assert f"127.0.0.1:{port}/readyz" in " ".join(svcs["coordinator"]["healthcheck"]["test"])
    assert prom["coordinator"]["static_configs"][0]["targets"] == [f"coordinator:{port}"]
    assert opts["trainer"]["--coordinator"] == opts["probe-worker"]["--coordinator"] == f"http://coordinator:{port}"
    # The trainer's and the workers' /metrics: bound on every interface of the container, on the scraped port.
    trainer_port, worker_port = opts["trainer"]["--metrics-port"], opts["probe-worker"]["--metrics-port"]
    assert opts["trainer"]["--metrics-host"] == opts["probe-worker"]["--metrics-host"] == "0.0.0.0"
    assert prom["trainer"]["static_configs"][0]["targets"] == [f"trainer:{trainer_port}"]
    assert prom["probe-worker"]["dns_sd_configs"] == [{"names": ["probe-worker"], "type": "A", "port": int(worker_port)}]
    assert svcs["trainer"]["expose"] == [trainer_port] and svcs["probe-worker"]["expose"] == [worker_port]
    datasource = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090" and svcs["prometheus"]["ports"] == ["9090:9090"]

    # Volumes: where each program reads and writes.
    def mounts(name: str) -> dict[str, tuple[str, bool]]:  # target -> (volume or host path, writable)
        out = {}
        for spec in svcs[name]["volumes"]:
            src, target, *mode = spec.split(":")
            out[target] = (src, mode != ["ro"])
        return out

    def on_volume(name: str, path: str) -> tuple[str, str, bool] | None:  # (volume, path inside it, writable)
        for target, (src, rw) in mounts(name).items():
            if path == target or path.startswith(target + "/"):
                return src, path[len(target):].lstrip("/"), rw
        return None

    env = {name: svcs[name]["environment"] for name in ("coordinator", "trainer", "probe-worker")}
    coordinator_blobs = f"{env['coordinator']['SPARECYCLES_CACHE']}/blobs"  # coordinator.settings._default_blob_dir
    used = {
        "coordinator": [coordinator_blobs],
        "trainer": [env["trainer"]["SPARECYCLES_BLOB_DIR"], opts["trainer"]["--run-dir"]],
        "probe-worker": [env["probe-worker"]["SPARECYCLES_BLOB_DIR"]],
    }
    assert on_volume("coordinator", coordinator_blobs) == ("blobs", "blobs", True)
    assert on_volume("trainer", env["trainer"]["SPARECYCLES_BLOB_DIR"]) == ("blobs", "blobs", True)  # writes shards
    assert on_volume("probe-worker", env["probe-worker"]["SPARECYCLES_BLOB_DIR"]) == ("blobs", "blobs", False)
    assert on_volume("trainer", opts["trainer"]["--run-dir"])[0] == "runs"
    for name, paths in used.items():
        dead = [t for t in mounts(name) if not any(p == t or p.startswith(t + "/") for p in paths)]
        assert not dead, f"{name} mounts {dead}, which its program never uses"
        image_dirs = _image_dirs(svcs[name].get("build", compose["x-app"]["build"])["dockerfile"])
        # What it writes off-volume (its cache) and every writable mount point: created and owned in the image.
        writes = [env[name]["SPARECYCLES_CACHE"]] + [t for t, (_, rw) in mounts(name).items() if rw]
        missing = [p for p in writes if p not in image_dirs]
        assert not missing, f"{name}'s image does not create {missing} owned by uid 10001"
    assert set(compose["volumes"]) >= {src for n in used for src, _ in mounts(n).values()}


def test_one_shot_services_do_not_restart_and_gpu_services_are_documented():
    compose = yaml.safe_load((ROOT / "docker/compose.yml").read_text())
    svcs = compose["services"]
    assert svcs["trainer"]["restart"] == "no"  # one-shot: `unless-stopped` would train the finished run again
    assert all(svcs[n]["restart"] == "unless-stopped" for n in ("redis", "coordinator", "probe-worker", "prometheus"))
    gpu = sorted(n for n, s in svcs.items() if "devices" in s.get("deploy", {}).get("resources", {}).get("reservations", {}))
    assert gpu == ["engine", "probe-worker", "serving-worker", "trainer"]  # the last two of `--profile serving`
    fleet = (ROOT / "README.md").read_text().split("## Deployment", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{n}`" in fleet for n in gpu) and "NVIDIA" in fleet  # README's Deployment section says who takes a GPU


def test_train_coordinator_serves_metrics_while_it_waits(tmp_path, monkeypatch, capsys):
    """`train --coordinator` serves /metrics from the start (here while it waits for an absent coordinator); an
    explicit port that is taken exits 2, the default one taken is a warning (another trainer on the host)."""
    import socket
    import sys

    import typer

    from api.server import free_port
    from trainer import cli as trainer_cli
    from trainer import metrics as trainer_metrics

    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_")},
           "SPARECYCLES_ADMIN_TOKEN": "x" * 24, "SPARECYCLES_REDIS_URL": "redis://127.0.0.1:6379/0"}
    proc = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "train", "--steps", "2", "--no-export",
                             "--optimizer", "zocurv-line", "--run-dir", str(tmp_path / "r"), "--coordinator",
                             f"http://127.0.0.1:{free_port()}", "--attach-wait", "60", "--metrics-port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        text = None
        while text is None and proc.poll() is None:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.2)
        assert text is not None, proc.communicate()[1].decode()[-2000:]
        assert "# TYPE sparecycles_trainer_step gauge" in text and "sparecycles_trainer_tokens" in text
    finally:
        proc.kill()
        proc.wait(timeout=30)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(typer.Exit) as exc:
            trainer_cli._serve_metrics(busy, "127.0.0.1", fleet=True)
        assert exc.value.exit_code == 2
        assert f"cannot serve metrics on 127.0.0.1:{busy}" in capsys.readouterr().err
        monkeypatch.setattr(trainer_metrics, "DEFAULT_PORT", busy)
        trainer_cli._serve_metrics(None, "127.0.0.1", fleet=True)  # a warning, training goes on
        assert f"warning: metrics not served: 127.0.0.1:{busy} is taken" in capsys.readouterr().err
