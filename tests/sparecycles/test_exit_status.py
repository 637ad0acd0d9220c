"""Every long-running command ends alike when stopped: exit status 128 + the signal, 143 after SIGTERM (`kill`,
`timeout`, Docker/Compose, Kubernetes) and 130 after Ctrl-C (SIGINT), as `train` and `up` do
(tests/sparecycles/test_signals.py). Real processes: each is started, its ready line awaited, then signalled once. `fleet` exited 0 after either signal and
`worker` with Celery's own statuses (0 after SIGTERM, its failure status after Ctrl-C) before."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from support.fleet import ROOT, Fleet, _free_port
from support.processes import processes_of, read_until, start_cli

STOPS = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]


def _stop(proc: subprocess.Popen, sig: int, seen: list[str]) -> tuple[int, str]:
    proc.send_signal(sig)
    out = "".join(seen) + proc.communicate(timeout=120)[0].decode(errors="replace")
    return proc.returncode, out


def _signalled_when_ready(proc: subprocess.Popen, ready: str, sig: int) -> tuple[int, str]:
    """Wait for `ready` in `proc`'s output, then send `sig` once (even if the wait failed); returns (exit status,
    every line it printed)."""
    seen: list[str] = []
    try:
        read_until(proc, ready, seen)
    finally:
        rc, out = _stop(proc, sig, seen)
    return rc, out


@pytest.fixture
def coordinator_only(tmp_path):
    """A coordinator process on real Redis (tests.support.fleet.Fleet, no workers)."""
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


@pytest.mark.parametrize(("sig", "status"), STOPS)
def test_coordinator_exits_128_plus_the_signal(sig, status, coordinator_only):
    """`sparecycles coordinator`, serving (uvicorn's start-up line seen): one signal ends it with 143 / 130."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port)],
                            env=coordinator_only.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc, out = _signalled_when_ready(proc, "Application startup complete", sig)
    assert rc == status, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize(("sig", "status"), STOPS)
def test_worker_exits_128_plus_the_signal(sig, status, coordinator_only):
    """`sparecycles worker` (Celery's solo pool), registered and consuming (its "ready on" line): 143 / 130, not
    Celery's 0 or failure status."""
    f = coordinator_only
    cmd = [sys.executable, "-m", "sparecycles.cli", "worker", "--coordinator", f.url, "--token", f.enroll_token,
           "--name", "x", "--cache-dir", str(f.tmp / "cache"), "--threads", "1", "--log-level", "INFO"]
    proc = subprocess.Popen(cmd, env=f.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc, out = _signalled_when_ready(proc, "ready on cpu", sig)
    assert rc == status, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize(("sig", "status"), STOPS)
def test_fleet_exits_128_plus_the_signal(sig, status, tmp_path):
    """`sparecycles fleet --workers 1`, ready (its "fleet ready" line): one signal stops every process it started,
    removes fleet.env and ends with 143 / 130 (0 before)."""
    folder = tmp_path / "fl"
    proc = start_cli(["fleet", "--workers", "1", "--folder", str(folder)], sigint_ignored=True)
    rc, out = _signalled_when_ready(proc, "fleet ready", sig)
    assert rc == status, out[-3000:]
    assert "stopping the fleet" in out and "Traceback" not in out, out[-3000:]
    assert processes_of(folder) == [] and not (folder / "fleet.env").exists()
