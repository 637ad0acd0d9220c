"""The images' recipes against the project: every package pyproject.toml installs is copied by both Dockerfiles
and let into the build context (.dockerignore), and nothing else is copied as a package (an image without `wire/`
could not run a single command). The images are built and run for real by tests/test_compose.py (slow lane)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ("docker/Dockerfile", "docker/Dockerfile.cuda")


def _packages() -> set[str]:
    """Top-level package names of pyproject.toml's setuptools `find` includes ("wire*" -> "wire")."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    names = {p.removesuffix("*") for p in include}
    assert all(re.fullmatch(r"[a-z_]+", n) for n in names), include
    # The same list as the layer contracts' root packages, and every folder of the repo root that is a package.
    assert names == set(cfg["tool"]["importlinter"]["root_packages"])
    assert names == {p.parent.name for p in ROOT.glob("*/__init__.py")}
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
    assert re.search(r"^COPY pyproject.toml README.md LICENSE \./$", text, re.M)  # pip install . needs all three


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
    assert len(pip_runs) == 2
    for run in pip_runs:
        assert "--mount=type=secret,id=ca_bundle" in run and "--mount=type=secret,id=pip_conf" in run
        assert "PIP_CERT=/run/secrets/ca_bundle" in run and "PIP_CONFIG_FILE=/run/secrets/pip_conf" in run
    assert not re.search(r"^(ENV|ARG) .*(PASSWORD|TOKEN|SECRET)", text, re.M)
    assert not re.search(r"^COPY .*\.(pem|crt)\b", text, re.M)
