"""`sparecycles fleet`: one command starts a fleet on this machine (embedded Valkey, coordinator, workers), prints
the environment lines, and the own-loop example (examples/hf_trainer.py) and `train --coordinator` run against it
with nothing but those lines; SIGTERM stops every process it started. The commands are the README's "A fleet" block,
run as written (in a shell that `source`s runs/fleet/fleet.env; the hf example's --out and the train run's size
scaled for CI)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from support.paths import ROOT
from support.processes import processes_of

NAMES = ["SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL", "SPARECYCLES_KEY_PREFIX",
         "SPARECYCLES_BLOB_DIR", "SPARECYCLES_ENROLLMENT_TOKEN"]


def _export_lines(proc: subprocess.Popen, timeout_s: float = 300.0) -> list[str]:
    """The `export` lines `sparecycles fleet` prints on stdout once its workers are up (read by a thread: a line
    may sit in the pipe reader's buffer, where select() does not see it)."""
    got: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [got.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while len(lines) < len(NAMES):
        try:
            lines.append(got.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"no environment lines within {timeout_s:.0f} s (exit code {proc.poll()})") from None
    return lines


def _fleet_block() -> list[str]:
    """The README's "A fleet" block: its command lines (comments dropped), in order."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## A fleet\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line and not line.startswith("#")]


@pytest.mark.slow
def test_own_loop_through_the_one_command_fleet(tmp_path):
    fleet_cmd, source, hf, train = _fleet_block()
    assert fleet_cmd == "sparecycles fleet --workers 2" and source == "source runs/fleet/fleet.env"
    assert hf.startswith("python examples/hf_trainer.py --coordinator") and train.startswith("sparecycles train ")
    folder = tmp_path / "runs" / "fleet"  # the default --folder, under the working directory
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the README's paths are the repository's
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_") and k != "REDIS_URL"}
    clean["PYTHONPATH"] = str(ROOT)
    if "SPARECYCLES_CACHE" in os.environ:
        clean["SPARECYCLES_CACHE"] = os.environ["SPARECYCLES_CACHE"]
    bin_dir = tmp_path / "bin"  # `sparecycles` and `python` as the README's shell has them
    bin_dir.mkdir()
    for name, run in (("sparecycles", f"{sys.executable} -m sparecycles.cli"), ("python", sys.executable)):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {run} \"$@\"\n")  # a venv's python: exec'd by its path
        (bin_dir / name).chmod(0o755)
    clean["PATH"] = f"{bin_dir}:{clean.get('PATH', '')}"
    log = open(tmp_path / "fleet.log", "w")
    proc = subprocess.Popen(["sh", "-c", f"exec {fleet_cmd}"], env=clean, stdout=subprocess.PIPE, stderr=log,
                            text=True, cwd=tmp_path)  # exec: SIGTERM below reaches `sparecycles fleet` itself
    try:
        lines = _export_lines(proc)
        assert [line.split("=", 1)[0] for line in lines] == [f"export {n}" for n in NAMES]
        assert (folder / "fleet.env").read_text() == "\n".join(lines) + "\n"
        assert (folder / "fleet.env").stat().st_mode & 0o077 == 0  # secrets: this user only
        hf_out = str(tmp_path / "hf")
        small = " --batch-size 4 --seq-len 32 --no-export --metrics-port 0"  # the README's run, smaller for CI
        script = f"{source} && {hf.replace('/tmp/hf-run', hf_out)} && {train}{small}"
        res = subprocess.run(["bash", "-c", script], env=clean, cwd=tmp_path, capture_output=True, text=True,
                             timeout=1200)
        assert res.returncode == 0, res.stderr[-4000:]
        got = json.loads((tmp_path / "hf" / "result.json").read_text())
        assert got["curvature_ready"] and got["rounds"]["curv_folded_rounds"] >= 1  # probe rounds on the workers
        assert [r["eval_on"] for r in got["fleet_records"]] == ["fleet", "fleet"]
        # `train`, attached by SPARECYCLES_COORDINATOR_URL alone: probes and evaluation on the fleet
        (run,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "fleet"]
        assert json.loads((run / "config.json").read_text())["probe_source"] == "fleet"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["evaluations"]["fleet"] >= 1, summary.get("evaluations")
        assert "probes and evaluation on the fleet" in res.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        log.close()
    assert code == 143, (tmp_path / "fleet.log").read_text()[-3000:]  # stopped by SIGTERM: 128 + 15
    assert not (folder / "fleet.env").exists() and processes_of(folder) == []
