"""`sparecycles fleet`: one command starts a fleet on this machine (embedded Valkey, coordinator, workers), prints
the environment lines, and the own-loop example (examples/hf_trainer.py) and `train --coordinator` run against it
with nothing but those lines; SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.processes import processes_of

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL", "SPARECYCLES_KEY_PREFIX",
         "SPARECYCLES_BLOB_DIR"]


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


@pytest.mark.slow
def test_own_loop_through_the_one_command_fleet(tmp_path):
    folder = tmp_path / "fleet"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_") and k != "REDIS_URL"}
    clean["PYTHONPATH"] = str(ROOT)
    if "SPARECYCLES_CACHE" in os.environ:
        clean["SPARECYCLES_CACHE"] = os.environ["SPARECYCLES_CACHE"]
    log = open(tmp_path / "fleet.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "fleet", "--workers", "1", "--folder", str(folder)],
                            env=clean, stdout=subprocess.PIPE, stderr=log, text=True, cwd=tmp_path)
    try:
        lines = _export_lines(proc)
        assert [line.split("=", 1)[0] for line in lines] == [f"export {n}" for n in NAMES]
        assert (folder / "fleet.env").read_text() == "\n".join(lines) + "\n"
        assert (folder / "fleet.env").stat().st_mode & 0o077 == 0  # secrets: this user only
        env = {**clean, **dict(line.removeprefix("export ").split("=", 1) for line in lines)}
        url = env["SPARECYCLES_COORDINATOR_URL"]
        res = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--coordinator", url,
                              "--out", str(tmp_path / "hf")], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        got = json.loads((tmp_path / "hf" / "result.json").read_text())
        assert got["curvature_ready"] and got["rounds"]["curv_folded_rounds"] >= 1  # probe rounds on the worker
        assert [r["eval_on"] for r in got["fleet_records"]] == ["fleet", "fleet"]
        # `train --coordinator`, from the same lines (SPARECYCLES_COORDINATOR_URL stands for --coordinator)
        res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", "--optimizer", "1.5spsa", "--probes", "2",
                              "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--no-export",
                              "--metrics-port", "0", "--run-dir", str(tmp_path / "train")], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        summary = json.loads((tmp_path / "train" / "summary.json").read_text())
        assert summary["evaluations"]["fleet"] >= 1, summary.get("evaluations")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        log.close()
    assert code == 0, (tmp_path / "fleet.log").read_text()[-3000:]
    assert not (folder / "fleet.env").exists() and processes_of(folder) == []
