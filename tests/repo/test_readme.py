"""README.md is the first hour's guide: short, in the first hour's order, its first commands the ones CI runs, and its
own-model example run here as written (offline: the tokenizer is the project's own GPT-2 BPE)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
ORDER = ["What it is", "Install", "First run", "Your model and data", "A fleet", "Deployment", "Troubleshooting"]


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|python)?\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_in_the_first_hours_order():
    assert len(README.encode()) < 20_000
    assert re.findall(r"^## (.+)$", README, flags=re.M) == ORDER
    assert not re.search(r"\bissue \d+|tests/(?:\w+/)*test_\w+\.py", README), "issue numbers and test files stay out of it"


def test_readme_test_command_is_the_one_ci_runs():
    """The README's first block: the main job, then the test command `.ci/run` runs (the same line)."""
    first = _blocks(README)[0].splitlines()
    assert first[0].startswith("bash tools/bootstrap.sh && .venv/bin/sparecycles up ")
    test_cmd = first[1].split("   #", 1)[0].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [line.strip() for line in ci]


def test_readme_test_command_sets_up_what_the_tests_need_and_lists_skip_reasons():
    """On a fresh machine the test command installs and starts the services the tests use (tools/test_services.sh
    through bootstrap's --test-services) and prints why each skipped test skipped; CI requires every service."""
    test_cmd = _blocks(README)[0].splitlines()[1].split("   #", 1)[0].strip()
    assert test_cmd.startswith("bash tools/bootstrap.sh --test-services && .venv/bin/python -m pytest ")
    assert " -rs " in test_cmd
    assert "export SPARECYCLES_TEST_SERVICES_STRICT=1" in (ROOT / ".ci" / "run").read_text()
    assert "bash tools/test_services.sh" in (ROOT / "tools" / "bootstrap.sh").read_text()
    res = subprocess.run(["bash", "tools/bootstrap.sh", "--no-such-flag"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "usage: bash tools/bootstrap.sh [--test-services]" in res.stderr


def test_readme_links_point_at_files():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def _commands(block: str, prefix: str) -> list[list[str]]:
    """The lines of `block` that start with `prefix`, as argv (the trailing `# comment` dropped)."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith(prefix)]


def test_own_model_commands_work_without_an_activated_venv():
    """"Your model and data" may be read without Install's `source .venv/bin/activate`: its commands name the venv's
    python and sparecycles (a bare `python` would miss transformers and the project)."""
    lines = [line for block in _blocks(_section("Your model and data")) for line in block.splitlines()]
    starts = [line.split()[0] for line in lines if re.match(r"[./\w-]*(python|sparecycles)\b", line)]
    assert starts and set(starts) == {".venv/bin/python", ".venv/bin/sparecycles"}, starts


@pytest.mark.slow
def test_own_model_example_runs_offline_as_written(tmp_path):
    """"Your model and data": the model folder made by the README's script (no network: HF_HUB_OFFLINE), `train`
    with that folder and a folder of text, the export loaded back, and `up`'s plan for the same model and data."""
    from support.user_data import real_documents

    section = _section("Your model and data")
    make, run = _blocks(section)[:2]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "SPARECYCLES_RUNS": str(tmp_path / "runs")}
    script = make.split("<<'EOF'\n", 1)[1].rsplit("EOF", 1)[0]
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "my-llama" / "config.json").is_file() and (tmp_path / "my-llama" / "tokenizer.json").is_file()
    (tmp_path / "my_texts").mkdir()
    for i, doc in enumerate(real_documents()):
        (tmp_path / "my_texts" / f"{i:03d}.txt").write_text(doc)
    (train,) = _commands(run, ".venv/bin/sparecycles train")
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", *train[1:]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (load,) = _commands(run, ".venv/bin/python -c")  # runs/ is SPARECYCLES_RUNS here, as ./runs is by default
    res = subprocess.run([sys.executable, *load[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "LlamaForCausalLM" in res.stdout, res.stderr[-3000:]
    (up,) = _commands(run, ".venv/bin/sparecycles up")
    _plan_matches_readme(up, tmp_path, env)


def _plan_matches_readme(up: list[str], cwd: Path, env: dict[str, str]) -> None:
    """`up`'s options as the README writes them pass every check, warn of nothing, and name the folder it says."""
    code = ("import sys; from sparecycles.up_plan import plan_up; from trainer.cli_settings import key_values\n"
            f"a = {up[2:]!r}; kw = dict(zip(a[0::2], a[1::2]))\n"
            "p = plan_up(settings={'model': kw['--model'], 'data': kw['--data'], 'steps': int(kw['--steps'])})\n"
            "print(p.out.name); print(p.warnings)")
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    name, warnings = res.stdout.splitlines()
    assert f"runs/{name}" in _section("Your model and data") and warnings == "()"


def _inline(text: str, prefix: str) -> list[str]:
    """Commands written in `text` starting with `prefix`: code-block lines and `inline code`, comments dropped."""
    lines = [line for block in _blocks(text) for line in block.splitlines()]
    found = [line.split("  #", 1)[0].strip() for line in lines] + re.findall(r"`([^`\n]+)`", text)
    return list(dict.fromkeys(c for c in found if c.startswith(prefix)))


def _cli(args: list[str], env: dict[str, str], cwd: Path, plan_only: bool = False) -> subprocess.CompletedProcess:
    """`sparecycles ARGS` as the README's shell runs it; `plan_only`: `up` stops once its plan is made (every
    option checked, the folder decided), printing the folder's name and the plan's warnings, and starts nothing."""
    code = ("import sys; import sparecycles.up as up\n"
            "def planned(plan, **kw):\n    print(plan.out.name); print(list(plan.warnings)); sys.exit(0)\n"
            "up.run_up = planned\n" if plan_only else "") + "import sys; from sparecycles.cli import app; app(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def test_install_and_first_run_commands_as_written(tmp_path):
    """"Install" and "First run": `sparecycles --help`, and every `sparecycles up` the section writes, through the
    real CLI up to its plan: every option passes, no warning, and the folder is the one the README names."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARECYCLES_RUNS": str(tmp_path / "runs")}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    (help_cmd,) = _inline(_section("Install"), "sparecycles --")
    res = _cli(shlex.split(help_cmd)[1:], env, tmp_path)
    assert res.returncode == 0 and "train" in res.stdout and "fleet" in res.stdout, res.stderr[-2000:]
    first = _section("First run")
    ups = _inline(first, "sparecycles up")
    assert ups == ["sparecycles up", "sparecycles up --steps 300", "sparecycles up --task sentiment"], ups
    for cmd in ups:
        res = _cli(shlex.split(cmd)[1:], env, tmp_path, plan_only=True)
        assert res.returncode == 0, res.stderr[-3000:]
        name, warnings = res.stdout.splitlines()[-2:]
        assert warnings == "[]", (cmd, warnings)
        if "sentiment" not in cmd:
            assert f"runs/{name}" in first, (cmd, name)


@pytest.mark.slow
def test_first_run_train_command_as_written(tmp_path):
    """"First run"'s one-process `sparecycles train` line, as written: it trains, exports and learns."""
    (train,) = _inline(_section("First run"), "sparecycles train ")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARECYCLES_RUNS": str(tmp_path / "runs")}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    res = _cli(shlex.split(train)[1:], env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 3.0 and (run / "export" / "config.json").is_file()
