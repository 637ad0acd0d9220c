"""The images' recipes against the project: every package pyproject.toml installs is copied by both Dockerfiles
and let into the build context (.dockerignore), and nothing else is copied as a package (an image without `wire/`
could not run a single command). The images are built and run for real by tests/deploy/test_compose.py (slow lane)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from support.paths import ROOT

DOCKERFILES = ("docker/Dockerfile", "docker/Dockerfile.cuda")


def _packages() -> set[str]:
    """Top-level package names of pyproject.toml's setuptools `find` includes ("wire*" -> "wire")."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    names = {p.removesuffix("*") for p in include}
    assert all(re.fullmatch(r"[a-z_]+", n) for n in names), include
    # The same list as the layer contracts' root packages, and every folder of the repo root that is a package, less
    # experiments/ (a root package of the contracts, never installed nor copied into an image).
    assert names == set(cfg["tool"]["importlinter"]["root_packages"]) - {"experiments"}
    assert names == {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"experiments"}
    return names


def _copied(dockerfile: str) -> set[str]:
    """Folders a Dockerfile copies to the same name under its WORKDIR (`COPY name name`)."""
    text = (ROOT / dockerfile).read_text()
    return {m.group(1) for m in re.finditer(r"^COPY (\S+) \1$", text, re.M)}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_copies_every_package(dockerfile):
    copied = _copied(dockerfile)
    assert copied == _packages(), f"{dockerfile}: missing {_packages() - copied}, extra {copied - _packages()}"
    text = (ROOT / dockerfile).read_text()
    # pip install . needs all three; pyproject.toml alone comes first (the dependencies' layer).
    assert re.search(r"^COPY pyproject.toml \./\n(.*\n)*COPY README.md LICENSE \./$", text, re.M)


def test_dockerignore_lets_in_exactly_what_the_images_copy():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"  # an allow-list: a developer's .venv and runs never enter the build context
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    assert allowed == _packages() | {"pyproject.toml", "README.md", "LICENSE"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_builds_without_a_hub_or_baked_credentials(dockerfile):
    """The base image and pip's sources are build arguments; a CA bundle or pip.conf only ever arrives as a
    BuildKit secret (mounted for one RUN, in no layer); every pip install sees both."""
    text = (ROOT / dockerfile).read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+\nFROM \$\{BASE_IMAGE\}$", text, re.M)
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "TORCH_PIP_ARGS"} <= args
    instructions = re.split(r"\n(?=[A-Z]+ )", text)  # a RUN continued over lines is one instruction
    pip_runs = [r for r in instructions if r.startswith("RUN") and re.search(r"\bpip3? install\b", r)]
    assert len(pip_runs) == 3  # torch, the dependencies, the project
    for run in pip_runs:
        assert "--mount=type=secret,id=ca_bundle" in run and "--mount=type=secret,id=pip_conf" in run
        assert "PIP_CERT=/run/secrets/ca_bundle" in run and "PIP_CONFIG_FILE=/run/secrets/pip_conf" in run
    assert not re.search(r"^(ENV|ARG) .*(PASSWORD|TOKEN|SECRET)", text, re.M)
    assert not re.search(r"^COPY .*\.(pem|crt)\b", text, re.M)


@pytest.mark.parametrize("compose", ("docker/compose.yml", "docker/compose.cpu.yml"))
def test_every_service_on_our_images_runs_a_sparecycles_subcommand(compose):
    """The images' ENTRYPOINT is `sparecycles`, so a service's `command` is its arguments: it must start with a
    subcommand, and a service that runs a shell must replace the entrypoint and `exec sparecycles SUBCOMMAND`.
    (Found by running compose.yml's trainer for real: its `command: [sh, -c, ...]` ran as `sparecycles sh -c ...`,
    "No such command 'sh'", in both compose files; no test had looked at the entrypoint.)"""
    import json

    import typer.main

    from sparecycles.cli import app

    subcommands = set(typer.main.get_command(app).commands)
    entrypoints = {json.loads(m.group(1)) == ["sparecycles"] for f in DOCKERFILES
                   for m in [re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / f).read_text(), re.M)]}
    assert entrypoints == {True}
    services = yaml.safe_load((ROOT / compose).read_text())["services"]
    def image(svc: dict) -> str:  # "${SPARECYCLES_IMAGE:-sparecycles:cpu}" -> "sparecycles:cpu"
        return re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", str(svc.get("image", "")))

    ours = {n: s for n, s in services.items() if image(s).split(":")[0] == "sparecycles"}
    assert {"coordinator", "trainer"} <= set(ours), sorted(ours)
    for name, svc in ours.items():
        argv = [*(svc.get("entrypoint") or ["sparecycles"]), *svc["command"]]
        if argv[:2] == ["sh", "-c"]:
            m = re.match(r"exec sparecycles (\S+) ", argv[2])
            assert m and len(argv) == 3, f"{compose} {name}: a shell line must exec sparecycles: {argv}"
            argv = ["sparecycles", m.group(1)]
        assert argv[0] == "sparecycles" and argv[1] in subcommands, f"{compose} {name} runs {argv[:3]}"


def test_readme_deployment_runs_the_commands_the_compose_test_runs():
    """README's Deployment block is what tests/deploy/test_compose.py runs: the two tools scripts, then compose up -d
    and down -v on docker/compose.cpu.yml with an env file (the test's own: fresh secrets, free ports)."""
    section = (ROOT / "README.md").read_text().split("\n## Deployment\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln.split("  #", 1)[0].strip() for ln in re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines()]
    assert lines == ["bash tools/dockerd.sh && bash tools/images.sh", "cp docker/.env.example docker/.env",
                     'dc="docker-compose -f docker/compose.cpu.yml --env-file docker/.env"',
                     "$dc run --rm check && $dc up -d", "$dc logs -f trainer",
                     'docker cp "$($dc ps -q trainer)":/data/run/export my-model', "$dc down -v"]
    test = (ROOT / "tests/deploy/test_compose.py").read_text()
    assert all(s in test for s in ('"tools/dockerd.sh"', '"tools/images.sh"', '"docker/compose.cpu.yml"',
                                   'compose("run", "--rm", "check"', 'compose("up", "-d"',
                                   'compose("logs", "-f", "trainer"', '"cp", f"{trainer}:/data/run/export"',
                                   'compose("down", "-v"'))


def _stub(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text(f"#!/bin/bash\n{body}\n")
    (folder / name).chmod(0o755)


@pytest.mark.parametrize("uid", [0, 1000])
def test_dockerd_sh_installs_docker_compose_when_missing(tmp_path, uid):
    """The Deployment block's `docker-compose` comes from its first line: tools/dockerd.sh installs Debian's package
    when no docker-compose is on PATH (as root with apt-get), and otherwise stops naming it. Run on a PATH of stubs
    only (`id`, `apt-get` recording its arguments and failing the install), so nothing is installed here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "id", f"echo {uid}")
    _stub(bin_dir, "apt-get", f'echo "$*" >> {tmp_path}/apt.log; [ "$1" = update ]')
    res = subprocess.run(["/bin/bash", str(ROOT / "tools/dockerd.sh")], env={"PATH": str(bin_dir)},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines() if (tmp_path / "apt.log").exists() else []
    if uid == 0:
        assert calls == ["update -qq", "install -y -qq --no-install-recommends docker-compose"]
    else:
        assert calls == [] and "docker-compose not installed, and this is not root with apt-get" in res.stderr


def test_the_composed_trainers_print_progress_lines_to_their_logs():
    """Without a terminal `train` prints a plain progress line every 5% of its steps (trainer.console); the compose
    files' trainers keep that default (no --no-progress), so `logs -f trainer` shows the run going."""
    env_example = (ROOT / "docker/.env.example").read_text()
    assert "--no-progress" not in env_example
    for compose in ("docker/compose.yml", "docker/compose.cpu.yml"):
        trainer = yaml.safe_load((ROOT / compose).read_text())["services"]["trainer"]
        assert "--no-progress" not in str(trainer["command"]) + str(trainer["environment"]), compose
