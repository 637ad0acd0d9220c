"""`docker compose up` for real: the CPU fleet of docker/compose.cpu.yml in containers, end to end.

tools/images.sh builds the images from Debian packages (no registry), each image passes a smoke test, then the
README's Deployment commands run: Redis, the coordinator, two CPU probe workers, the trainer and Prometheus,
every one on the host's network on ports of 127.0.0.1 this test picks (tools/dockerd.sh's daemon has no bridge:
nothing else is addressed). A tiny ZO-Curv run trains through the composed fleet with --require-fleet (a run the
fleet gave nothing exits 1); Prometheus has every target up and data in the trainer's and the workers' series; a
worker killed while it holds a probe task leaves the run to finish, its round re-issued (summary.json's
fleet.tasks_redispatched); `down` then `up` again reuses the finished run; `down -v` leaves no container, network
or volume. `bash tools/bootstrap.sh --test-services` installs docker.io and starts the daemon (tools/dockerd.sh)."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from support.paths import ROOT

COMPOSE = shutil.which("docker-compose")
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
IMAGE = "sparecycles:cpu"
PACKAGES = ("sparecycles", "benchmarks", "coordinator", "api", "probe_worker", "trainer", "probe_kernels", "fleet",
            "wire")
STEPS = 20
TRAIN_ARGS = (f"--preset demo --steps {STEPS} --batch-size 4 --seq-len 32 --curvature-interval 4 --eval-every 10 "
              "--eval-batches 2 --eval-on trainer --optimizer zocurv-line --fleet-wait sync --require-fleet "
              "--export")  # the default progress: plain lines in `logs`, without a terminal
PORTS = ("COORDINATOR_PORT", "REDIS_PORT", "PROMETHEUS_PORT", "TRAINER_METRICS_PORT", "WORKER1_METRICS_PORT",
         "WORKER2_METRICS_PORT")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(COMPOSE is None or DOCKER is None or shutil.which("dockerd") is None,
                       reason="needs Debian's docker.io and docker-compose (tools/bootstrap.sh --test-services)"),
]


def _run(*argv: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    assert not check or res.returncode == 0, f"{' '.join(argv)} -> {res.returncode}\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
    return res


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Fleet:
    """One compose project of docker/compose.cpu.yml with its own env file (fresh secrets, free ports)."""

    def __init__(self, tmp_path: Path) -> None:
        self.project = f"sc{secrets.token_hex(4)}"
        self.env = {"SPARECYCLES_REDIS_PASSWORD": secrets.token_urlsafe(24),
                    "SPARECYCLES_ADMIN_TOKEN": secrets.token_urlsafe(24),
                    "SPARECYCLES_ENROLLMENT_TOKEN": secrets.token_urlsafe(24),
                    "SPARECYCLES_CPU_TRAIN_ARGS": TRAIN_ARGS,
                    **{k: str(p) for k, p in zip(PORTS, _free_ports(len(PORTS)))}}
        self.env_file = tmp_path / "compose.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run(COMPOSE, "-p", self.project, "-f", str(ROOT / "docker/compose.cpu.yml"), "--env-file",
                    str(self.env_file), *args, timeout=timeout, check=check)

    def url(self, port_var: str) -> str:
        return f"http://127.0.0.1:{self.env[port_var]}"

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def left(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project still on the daemon."""
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: _run(DOCKER, *cmd, "--filter", label, "-q").stdout.split()
                for kind, cmd in (("containers", ("ps", "-a")), ("networks", ("network", "ls")),
                                  ("volumes", ("volume", "ls")))}

    def summary(self) -> str:
        """summary.json from the trainer's `runs` volume, read by a throwaway container."""
        return _run(DOCKER, "run", "--rm", "--network", "none", "-v", f"{self.project}_runs:/data:ro",
                    "--entrypoint", "cat", IMAGE, "/data/run/summary.json").stdout


def _wait(what: str, cond, timeout_s: float = 600, every: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what}")


def _get(url: str, **params) -> httpx.Response | None:
    try:
        return httpx.get(url, params=params, timeout=5)
    except httpx.HTTPError:
        return None


def _metric(url: str, name: str) -> float | None:
    r = _get(f"{url}/metrics")
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", r.text, re.M) if r is not None else None
    return float(m.group(1)) if m else None


def _held_tasks(container: str) -> set[str]:
    """Probe tasks a worker received and has not finished, from Celery's log lines (`Task NAME[ID] received`, then
    `... succeeded|failed|raised|retry|rejected ...` for the same ID)."""
    res = _run(DOCKER, "logs", container, timeout=60)
    log = res.stdout + res.stderr
    received = set(re.findall(r"Task sparecycles\.probe\[([0-9a-f-]+)\] received", log))
    finished = set(re.findall(r"Task sparecycles\.probe\[([0-9a-f-]+)\] (?!received)", log))
    return received - finished


def _kill_holding_a_task(fleet: Fleet, service: str) -> None:
    """SIGKILL `service` while it holds a probe task (frozen first, so the task cannot finish in between)."""
    box = fleet.container(service)
    for _ in range(200):
        _wait(f"{service} to take a probe task", lambda: _held_tasks(box), timeout_s=300, every=0.05)
        frozen = _run(DOCKER, "pause", box, check=False)
        if frozen.returncode != 0:  # the cgroup freezer can time out on a loaded machine ("unable to freeze")
            assert "unable to freeze" in frozen.stderr, frozen.stderr
            _run(DOCKER, "unpause", box, check=False)  # a partly frozen cgroup thawed; try again
            continue
        time.sleep(1)  # the log lines it wrote before the freeze reach the daemon's log file
        if _held_tasks(box):
            _run(DOCKER, "kill", box)
            return
        _run(DOCKER, "unpause", box)
    raise AssertionError(f"{service} never held a probe task when frozen")


@pytest.mark.timeout(2400)  # a clean machine builds the images first (debootstrap, pip): minutes
def test_compose_cpu_fleet_trains_survives_a_killed_worker_and_cleans_up(tmp_path):
    # The images, from Debian packages; a second run of the script keeps them.
    start = time.monotonic()
    _run("bash", str(ROOT / "tools/dockerd.sh"), timeout=300)
    built = _run("bash", str(ROOT / "tools/images.sh"), timeout=1800).stdout
    print(f"compose: images in {time.monotonic() - start:.0f} s:\n{built}")
    assert re.search(r"^sparecycles:cpu \S+", built, re.M), built
    again = _run("bash", str(ROOT / "tools/images.sh"), timeout=300).stdout
    assert again.count(": up to date") == 5, again  # content-hash labels: nothing changed, nothing rebuilt

    # Each image's smoke test: the CLI and its subcommands start, every root package imports.
    for args in (["--help"], ["coordinator", "--help"], ["worker", "--help"], ["train", "--help"]):
        assert "Usage" in _run(DOCKER, "run", "--rm", "--network", "none", IMAGE, *args).stdout
    imports = f"import {', '.join(PACKAGES)}, torch; print(torch.__version__)"
    assert "+cpu" in _run(DOCKER, "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c",
                          imports).stdout
    assert "Redis server v=" in _run(DOCKER, "run", "--rm", "--network", "none", "sparecycles-redis:bookworm",
                                     "redis-server", "--version").stdout
    version = _run(DOCKER, "run", "--rm", "--network", "none", "sparecycles-prometheus:bookworm", "--version")
    assert "prometheus, version" in version.stdout + version.stderr

    fleet = Fleet(tmp_path)
    try:
        # A placeholder secret: the README's `run --rm check` prints the refusal naming the variable and exits 2;
        # `up -d` alone fails on `check` too, nothing else started, the reason in `logs check`.
        good = fleet.env_file.read_text()
        fleet.env_file.write_text(good.replace(fleet.env["SPARECYCLES_ADMIN_TOKEN"],
                                               "replace-with-a-long-random-string"))
        refused = fleet.compose("run", "--rm", "check", timeout=300, check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "refusing to start: SPARECYCLES_ADMIN_TOKEN is a placeholder" in refused.stdout + refused.stderr
        refused = fleet.compose("up", "-d", timeout=600, check=False)
        assert refused.returncode != 0 and "check" in refused.stdout + refused.stderr
        why = fleet.compose("logs", "check", timeout=60).stdout
        assert "refusing to start: SPARECYCLES_ADMIN_TOKEN is a placeholder" in why, why
        assert fleet.container("coordinator") == "" and fleet.container("redis") == ""
        fleet.compose("down", timeout=300)
        fleet.env_file.write_text(good)

        # The README's commands. `up -d` returns once the coordinator is healthy (the others depend on it).
        accepted = fleet.compose("run", "--rm", "check", timeout=300)
        assert "settings accepted" in accepted.stdout + accepted.stderr
        fleet.compose("up", "-d", timeout=600)
        trainer = fleet.container("trainer")
        assert trainer and all(fleet.container(s) for s in ("probe-worker-1", "probe-worker-2", "prometheus"))
        assert _get(f"{fleet.url('COORDINATOR_PORT')}/readyz").status_code == 200
        assert fleet.left()["networks"] == []  # host networking: compose made no network

        # Every target up at once while the trainer runs: the coordinator, the trainer, both workers.
        prom = f"{fleet.url('PROMETHEUS_PORT')}/api/v1"

        def all_up() -> list[dict]:
            r = _get(f"{prom}/targets")
            targets = r.json()["data"]["activeTargets"] if r is not None and r.status_code == 200 else []
            return targets if len(targets) == 4 and all(t["health"] == "up" for t in targets) else []

        up = _wait("every Prometheus target up", all_up, timeout_s=300)
        assert {t["labels"]["job"] for t in up} == {"coordinator", "trainer", "probe-worker"}

        # Mid-run, after the first round: one worker killed while it holds a probe task.
        trainer_url = fleet.url("TRAINER_METRICS_PORT")
        _wait("the trainer's 4th step", lambda: (_metric(trainer_url, "sparecycles_trainer_step") or 0) >= 4)
        _kill_holding_a_task(fleet, "probe-worker-2")
        code = _run(DOCKER, "wait", trainer, timeout=900).stdout.strip()
        log = _run(DOCKER, "logs", trainer, timeout=60)
        assert code == "0", log.stdout[-3000:] + log.stderr[-3000:]  # --require-fleet: the fleet's rounds folded
        # The README's next commands: the trainer's progress lines, then the model copied out before `down -v`.
        progress = fleet.compose("logs", "-f", "trainer", timeout=120).stdout
        assert re.search(rf"zocurv-line \S+ step {STEPS}/{STEPS} \(100%\)", progress), progress[-3000:]
        _run(DOCKER, "cp", f"{trainer}:/data/run/export", str(tmp_path / "my-model"), timeout=120)
        assert (tmp_path / "my-model" / "config.json").is_file()
        assert any(p.suffix == ".safetensors" for p in (tmp_path / "my-model").iterdir())

        summary = json.loads(fleet.summary())
        assert summary["steps"] == STEPS and summary["optimizer"] == "zocurv-line"
        assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
        # Sync rounds: none still out at the end (a round of the killed worker may have gone stale and been
        # dropped before its re-issued seeds came back: `dropped` counts it, --require-fleet saw others fold).
        assert summary["rounds_skipped"]["pending_at_end"] == 0, summary
        assert summary["fleet"]["peak_workers"] == 2, summary
        # The task the killed worker held can only complete by the coordinator re-issuing its seeds.
        assert summary["fleet"]["tasks_redispatched"] >= 1, summary
        assert summary["fleet"]["results_accepted"] > 0, summary
        print(f"compose: trained {STEPS} steps in {summary['wall_s_this_invocation']:.0f} s, fleet {summary['fleet']}, "
              f"warnings {summary.get('warnings')}")

        # Prometheus kept the trainer's and both workers' series; the killed worker's target is down.
        end = time.time()

        def series(expr: str) -> dict[str, float]:
            r = httpx.get(f"{prom}/query", params={"query": f"max_over_time(({expr})[15m:2s])", "time": end},
                          timeout=30).json()
            return {s["metric"].get("instance", ""): float(s["value"][1]) for s in r["data"]["result"]}

        assert max(series('sparecycles_trainer_step{run="zocurv-line"}').values()) >= 4
        probes = series("sparecycles_worker_probes_evaluated_total")
        # Both workers' series were scraped (the killed one may have held its first task: its count can be 0).
        assert len(probes) == 2 and max(probes.values()) > 0, probes
        assert max(series('sum(sparecycles_workers{state="active"})').values()) == 2
        worker2 = f"127.0.0.1:{fleet.env['WORKER2_METRICS_PORT']}"
        _wait("the killed worker's target down", lambda: any(
            t["scrapeUrl"].startswith(f"http://{worker2}/") and t["health"] == "down"
            for t in (_get(f"{prom}/targets").json()["data"]["activeTargets"])), timeout_s=120)

        # down, then up again: the finished run is reused, not trained twice.
        before = fleet.summary()
        fleet.compose("down", timeout=300)
        assert fleet.left()["containers"] == [] and len(fleet.left()["volumes"]) == 4  # volumes kept
        fleet.compose("up", "-d", timeout=600)
        trainer = fleet.container("trainer")
        assert _run(DOCKER, "wait", trainer, timeout=300).stdout.strip() == "0"
        assert "reused, nothing trained" in _run(DOCKER, "logs", trainer, timeout=60).stderr
        assert fleet.summary() == before
    finally:
        fleet.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
    assert fleet.left() == {"containers": [], "networks": [], "volumes": []}
