"""Secrets as shipped: every placeholder the repository ships (docker/.env.example, any literal secret in docker/
or ops/) is refused at start-up by the program that reads it, naming the variable; so are empty and short tokens
and equal admin and enrollment tokens. SPARECYCLES_DEV_MODE=1 still accepts anything (README, Security)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from coordinator.settings import CoordinatorSettings, secret_problem, url_password_problem
from support.paths import ROOT

SECRET_NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*(?:TOKEN|PASSWORD|SECRET|PASSWD)[A-Za-z0-9_]*)\s*[=:]\s*(\S+)",
                         re.IGNORECASE)
URL_PASSWORD = re.compile(r"://[^/\s:@]*:([^@\s]+)@")
REQUIREPASS = re.compile(r"--requirepass\s+(\S+)")


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (ROOT / "docker/.env.example").read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _shipped_files(root: Path) -> list[Path]:
    """The files of docker/ and ops/ the repository ships: those git tracks, never a file a user made by following
    the docs (docker/.env with the real secrets, which .gitignore keeps out). Outside a git checkout (a copied
    tree): every file except .env ones."""
    res = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "docker", "ops"], capture_output=True,
                         text=True)
    if res.returncode == 0 and res.stdout:
        return sorted(root / rel for rel in res.stdout.split("\0") if rel and (root / rel).is_file())
    return sorted(p for d in ("docker", "ops") for p in (root / d).rglob("*") if p.is_file() and p.name != ".env")


def _shipped_secrets(root: Path = ROOT) -> dict[str, str]:
    """Every literal value in docker/ and ops/ (as shipped: `_shipped_files`) that looks like a secret ("FILE:LINE
    NAME" -> value): NAME=VALUE or NAME: VALUE with NAME containing TOKEN/PASSWORD/SECRET, a password inside a URL,
    redis --requirepass. Values taken from the environment (${...}, $$VAR) are not literals."""
    found = {}
    for path in _shipped_files(root):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            line = re.sub(r"\$\{[^}]*\}", "${}", line)  # ${VAR:?message}: from the environment
            hits = [(m.group(1), m.group(2)) for m in SECRET_NAME.finditer(line)]
            hits += [("url password", m.group(1)) for m in URL_PASSWORD.finditer(line)]
            hits += [("requirepass", m.group(1)) for m in REQUIREPASS.finditer(line)]
            for name, value in hits:
                value = value.strip("\"',;")
                if value and not value.startswith("$"):
                    found[f"{path.relative_to(root)}:{n} {name}"] = value
    return found


def test_a_users_docker_env_is_not_read_and_is_ignored_by_git(tmp_path):
    """The Deployment section's `cp docker/.env.example docker/.env` (then real secrets in it) changes neither what
    counts as shipped nor git's status: docker/.env is ignored, and the scan reads only tracked files."""
    check = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "docker/.env"])
    assert check.returncode == 0, "docker/.env (the user's real secrets) must be ignored by git"
    repo = tmp_path / "clone"
    (repo / "docker").mkdir(parents=True)
    (repo / "ops").mkdir()
    (repo / "docker/.env.example").write_text("SPARECYCLES_ADMIN_TOKEN=replace-with-a-long-random-string\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "docker/.env.example"], check=True)
    (repo / "docker/.env").write_text("SPARECYCLES_ADMIN_TOKEN=k3J9-qwZr_81xPLmv0aTy-real\n")
    shipped = {"docker/.env.example:1 SPARECYCLES_ADMIN_TOKEN": "replace-with-a-long-random-string"}
    assert _shipped_secrets(repo) == shipped
    (repo / ".git").rename(repo / "not-git")  # a copied tree without git: .env files still left out
    assert _shipped_secrets(repo) == shipped


def test_every_shipped_placeholder_is_refused():
    env = _env_example()
    shipped = _shipped_secrets()
    secret_vars = {k for k in env if re.search("TOKEN|PASSWORD|SECRET", k)}
    assert len(secret_vars) >= 4  # redis, admin, enrollment, grafana
    assert {k.split()[-1] for k in shipped} >= secret_vars  # the scan sees .env.example's own lines
    refused = {where: secret_problem(value) for where, value in shipped.items()}
    assert all(refused.values()), f"shipped secrets a service would accept: {[k for k, v in refused.items() if not v]}"
    for value in set(shipped.values()):
        assert url_password_problem(f"redis://:{value}@redis:6379/0")  # also inside the Redis URL


def test_settings_name_each_refused_variable(monkeypatch):
    for key in [k for k in os.environ if k.startswith("SPARECYCLES_") or k == "REDIS_URL"]:
        monkeypatch.delenv(key)
    good_admin, good_enroll = "a" * 16, "e" * 24
    cases = [
        ({"admin_token": "", "enrollment_token": good_enroll}, "SPARECYCLES_ADMIN_TOKEN is empty"),
        ({"admin_token": good_admin, "enrollment_token": "short-token"},
         "SPARECYCLES_ENROLLMENT_TOKEN is shorter than 16"),
        ({"admin_token": "Replace-With-A-Long-Random-String", "enrollment_token": good_enroll},
         "SPARECYCLES_ADMIN_TOKEN is a placeholder"),
        ({"admin_token": good_admin, "enrollment_token": good_admin}, "are equal"),
        ({"admin_token": good_admin, "enrollment_token": good_enroll,
          "redis_url": "redis://:replace-with-a-long-random-string@redis:6379/0"},
         "SPARECYCLES_REDIS_URL (or REDIS_URL) has a password that is a placeholder"),
        ({"admin_token": good_admin, "enrollment_token": good_enroll, "broker_url": "redis://:changeme@b:6379/0"},
         "SPARECYCLES_BROKER_URL has a password that is the well-known default"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValidationError) as exc:
            CoordinatorSettings(**kwargs)
        assert words in str(exc.value), (kwargs, str(exc.value))
    # Accepted: 16 random-looking characters, a short Redis password (an external Redis may have one), dev mode.
    CoordinatorSettings(admin_token=good_admin, enrollment_token=good_enroll, redis_url="redis://:pw@h:6379/0")
    CoordinatorSettings(admin_token="replace-with-a-long-random-string", enrollment_token="", dev_mode=True)


def _compose_env(service: str) -> dict[str, str]:
    """The environment docker/compose.yml gives `service` with docker/.env.example as its env file (compose's
    ${VAR}, ${VAR:?msg} and ${VAR:-default} interpolation, enough for our file)."""
    values = _env_example()
    svc = yaml.safe_load((ROOT / "docker/compose.yml").read_text())["services"][service]

    def interpolate(text: str) -> str:
        return re.sub(r"\$\{(\w+)(?::[?-][^}]*)?\}", lambda m: values.get(m.group(1), ""), str(text))

    return {k: interpolate(v) for k, v in (svc.get("environment") or {}).items()}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_") and k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("compose", ["docker/compose.yml", "docker/compose.cpu.yml"])
def test_a_one_shot_check_refuses_placeholders_before_any_service_starts(compose):
    """Each compose file's `check` runs `coordinator --check` with the coordinator's secrets; every service that
    takes a secret waits for it to succeed (directly or through a service that does), so a refused secret stops
    `up -d` at `check` with the reason in its output. `coordinator --check` exits 2 naming each refused variable, 0 for good ones."""
    services = yaml.safe_load((ROOT / compose).read_text())["services"]
    check = services["check"]
    assert check["command"] == ["coordinator", "--check"] and check["restart"] == "no"
    secrets = {k for k in services["coordinator"]["environment"] if re.search("TOKEN|REDIS_URL", k)}
    assert secrets <= set(check["environment"]) and len(secrets) == 3, secrets

    def waits_for_check(name: str) -> bool:
        deps = services[name].get("depends_on") or {}
        deps = deps if isinstance(deps, dict) else {d: {} for d in deps}
        return any(d == "check" and c.get("condition") == "service_completed_successfully" or
                   d != "check" and waits_for_check(d) for d, c in deps.items())

    with_secrets = [n for n, svc in services.items() if n != "check" and re.search(
        "TOKEN|PASSWORD|REDIS_URL", str(svc.get("environment", "")) + str(svc.get("command", "")))]
    assert {"redis", "coordinator", "trainer"} <= set(with_secrets)
    assert all(waits_for_check(n) for n in with_secrets), compose

    env = {k: v for k, v in _compose_env("coordinator").items() if k in secrets}
    res = _run(["coordinator", "--check"], env)
    assert res.returncode == 2 and res.stderr.startswith("refusing to start: "), res.stderr
    assert all(f"{var} " in res.stderr for var in secrets), res.stderr
    good = {"SPARECYCLES_ADMIN_TOKEN": "k3J9-qwZr_81xPLmv0aTy", "SPARECYCLES_ENROLLMENT_TOKEN": "Zq8-vT1mW_4bNc7yLp2e",
            "SPARECYCLES_REDIS_URL": "redis://:Hx7-pL2q_Wm9vRt4yK8s@127.0.0.1:6380/0"}
    res = _run(["coordinator", "--check", "--port", "1"], good)
    assert res.returncode == 0 and "settings accepted" in res.stderr, res.stderr


def test_services_refuse_the_env_example_at_start_up(monkeypatch):
    """`docker compose up` with docker/.env.example unchanged: the coordinator, the workers, the trainer and
    Grafana each exit at once naming the variables to set."""
    res = _run(["coordinator", "--port", "1"], _compose_env("coordinator"))
    assert res.returncode == 2, res.stderr
    for var in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_ENROLLMENT_TOKEN", "SPARECYCLES_REDIS_URL"):
        assert f"{var} " in res.stderr, res.stderr
    assert "SPARECYCLES_REDIS_PASSWORD" in res.stderr and "replace-with-a-long" not in res.stderr  # no value echoed

    res = _run(["worker", "--coordinator", "http://127.0.0.1:1"], _compose_env("probe-worker"))
    assert res.returncode == 2 and "SPARECYCLES_ENROLLMENT_TOKEN" in res.stderr and "placeholder" in res.stderr, \
        res.stderr

    from fleet.attach import FleetError, FleetSettings, attach

    for key, value in _compose_env("trainer").items():  # attach() reads the environment, as `train` does
        monkeypatch.setenv(key, value)
    with pytest.raises(FleetError, match=r"SPARECYCLES_ADMIN_TOKEN \(it is a placeholder.*"
                                         r"SPARECYCLES_REDIS_URL \(it has a password that is a placeholder"):
        attach("http://127.0.0.1:1", wait_s=0)
    monkeypatch.setenv("SPARECYCLES_DEV_MODE", "1")
    assert FleetSettings().admin_token.get_secret_value() == "replace-with-a-long-random-string"

    # Grafana's guard (its compose entrypoint), run by sh with `exec /run.sh` replaced by a marker.
    script = yaml.safe_load((ROOT / "docker/compose.yml").read_text())["services"]["grafana"]["entrypoint"][2]
    script = script.replace("$$", "$").replace('exec /run.sh "$@"', "echo grafana-starts")
    grafana = _compose_env("grafana")
    for pw, started in [(grafana["GF_SECURITY_ADMIN_PASSWORD"], False), ("short", False),
                        ("an-ExAmple-password-of-length", False), ("k3J9-qwZr_81xPLmv0aTy", True)]:
        res = subprocess.run(["sh", "-c", script, "grafana"], env={"GF_SECURITY_ADMIN_PASSWORD": pw, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=30)
        assert (res.returncode == 0 and "grafana-starts" in res.stdout) == started, (pw, res.stderr)
        assert started or "GRAFANA_ADMIN_PASSWORD" in res.stderr
