"""`sparecycles fleet` checks before it starts anything: devices as `up` checks them, a --folder that is a file, and
a folder another fleet holds (its lock) are one line and exit 2, with nothing started and the other fleet's files
untouched. Fast: each refusal comes before any service starts."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT


def _fleet(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env["SPARECYCLES_CACHE"] = os.environ.get("SPARECYCLES_CACHE", str(Path.home() / ".cache" / "sparecycles"))
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", "fleet", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_cuda_workers_on_a_machine_without_cuda_are_refused_before_anything_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # a GPU host accepts cuda:0; the refusal is what a CPU machine must say
    folder = tmp_path / "fl"
    line = _one_error_line(_fleet(tmp_path, "--worker-devices", "cuda:0", "--folder", str(folder)))
    assert "--worker-devices cuda:0: no CUDA device is visible here" in line
    assert not folder.exists()  # no blobs/, logs/ or valkey/ left behind


def test_a_malformed_device_names_the_option(tmp_path):
    line = _one_error_line(_fleet(tmp_path, "--worker-devices", "gpu0", "--folder", str(tmp_path / "fl")))
    assert "--worker-devices: 'gpu0' is not a torch device" in line
    assert not (tmp_path / "fl").exists()


def test_a_folder_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{}\n")
    line = _one_error_line(_fleet(tmp_path, "--folder", str(path)))
    assert "not a folder" in line and path.read_text() == "{}\n"


def test_a_folder_another_fleet_holds_is_refused_and_its_env_file_kept(tmp_path):
    folder = tmp_path / "fl"
    folder.mkdir()
    (folder / "fleet.env").write_text("export SPARECYCLES_COORDINATOR_URL=http://127.0.0.1:1\n")
    fd = os.open(folder / "fleet.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the running fleet holds
        os.pwrite(fd, b"4242\n", 0)
        line = _one_error_line(_fleet(tmp_path, "--workers", "1", "--folder", str(folder)))
    finally:
        os.close(fd)
    assert f"a fleet already runs in {folder} (pid 4242)" in line
    assert (folder / "fleet.env").read_text() == "export SPARECYCLES_COORDINATOR_URL=http://127.0.0.1:1\n"
    assert sorted(p.name for p in folder.iterdir()) == ["fleet.env", "fleet.lock"]  # no Valkey, logs or blobs


def test_fleet_options_are_one_typed_model_with_its_bounds() -> None:
    """FleetOptions (generated into `sparecycles fleet`): defaults as documented, a worker count outside 1..64 and
    an empty device list refused without any CLI; through the CLI, one line and exit 2, nothing started."""
    import pydantic
    from typer.testing import CliRunner

    from sparecycles.cli import app
    from sparecycles.fleet_cli import FleetOptions

    opts = FleetOptions()
    assert (opts.workers, opts.folder, opts.worker_devices) == (2, Path("runs/fleet"), None)
    for bad in ({"workers": 0}, {"workers": 65}, {"worker_devices": ""}):
        with pytest.raises(pydantic.ValidationError):
            FleetOptions(**bad)
    res = CliRunner().invoke(app, ["fleet", "--workers", "0"])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "error: --workers: Input should be greater than or equal to 1"], res.output
