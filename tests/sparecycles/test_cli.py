"""The console script: lazy imports, help, and clear errors for bad input."""

from __future__ import annotations

import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_import_pulls_no_torch_celery_or_fastapi():
    code = ("import sys, sparecycles.cli; heavy = [m for m in ('torch', 'celery', 'fastapi', 'triton') "
            "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_help_lists_every_command():
    res = _cli("--help")
    assert res.returncode == 0
    for cmd in ("up", "train", "export", "data", "coordinator", "worker", "bench"):
        assert cmd in res.stdout
    bench = _cli("bench", "--help")
    for cmd in ("kernels", "intake", "fleet", "serving"):
        assert cmd in bench.stdout


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    res = _cli("train", "--preset", "gpt2-nope", "--run-dir", str(tmp_path / "r"), "--no-progress")
    assert res.returncode == 2
    assert "unknown" in res.stderr.lower() and "gpt2-tiny" in res.stderr and "Traceback" not in res.stderr
    res = _cli("train", "--lr", "-1", "--run-dir", str(tmp_path / "r2"))
    assert res.returncode == 2 and "lr" in res.stderr
    res = _cli("train", "--optimizer", "sgd", "--run-dir", str(tmp_path / "r3"))
    assert res.returncode == 2 and "optimizer" in res.stderr


def test_help_is_whole_at_80_columns():
    """Every line fits 80 columns, nothing is cut with an ellipsis (env-var names of `worker` included)."""
    import os

    env = {**os.environ, "COLUMNS": "80"}
    for cmd in ([], ["up"], ["train"], ["worker"], ["bench"]):
        res = subprocess.run([sys.executable, "-m", "sparecycles.cli", *cmd, "--help"], capture_output=True,
                             text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        cut = [line for line in lines if line.rstrip().endswith(("...", "…")) and "Usage:" not in line]
        assert max(map(len, lines)) <= 80 and not cut, (cmd, cut, res.stdout)
        if cmd == ["worker"]:
            assert "SPARECYCLES_ENROLLMENT_TOKEN" in res.stdout
