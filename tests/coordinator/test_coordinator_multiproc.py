"""Several coordinator processes: /metrics sums every process's counters (prometheus-client multiprocess
mode), and the Redis-backed gauges are reported once, not once per process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from api.server import free_port, serve_processes, settings_env
from coordinator.metrics import CoordinatorMetrics
from support.coordinator import cleanup, make_settings
from support.paths import ROOT


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _per_process(mp_dir: Path, name: str, labels: dict[str, str]) -> dict[str, float]:
    """One sample's value in each process's counter file (file stem counter_<pid> -> value)."""
    out = {}
    for f in sorted(mp_dir.glob("counter_*.db")):
        for metric in MultiProcessCollector.merge([str(f)], accumulate=True):
            for s in metric.samples:
                if s.name == name and s.labels == labels:
                    out[f.stem] = s.value
    return out


def test_exposition_sums_counters_and_histograms_of_all_processes(tmp_path, monkeypatch):
    # Two separate processes write their metrics to the same directory, as uvicorn workers do.
    code = textwrap.dedent(
        """
        import sys
        from coordinator.metrics import CoordinatorMetrics
        n, age = int(sys.argv[1]), int(sys.argv[2])
        m = CoordinatorMetrics()
        m.results.labels("accepted").inc(n)
        m.results.labels("stale").inc(1)
        for _ in range(n):
            m.result_age.observe(age)
        """
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for n, age in ((5, 0), (7, 3)):
        subprocess.run([sys.executable, "-c", code, str(n), str(age)], env=env, cwd=ROOT, check=True)
    assert len(list(tmp_path.glob("counter_*.db"))) == 2

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    m = CoordinatorMetrics()
    m.attach_live(lambda: {"active": 3, "lost": 1}, lambda: {"r": 4})
    got = _samples(m.exposition().decode())
    assert got[("sparecycles_intake_results_total", (("outcome", "accepted"),))] == 12
    assert got[("sparecycles_intake_results_total", (("outcome", "stale"),))] == 2
    assert got[("sparecycles_result_age_versions_count", ())] == 12
    assert got[("sparecycles_result_age_versions_sum", ())] == 7 * 3
    assert got[("sparecycles_result_age_versions_bucket", (("le", "0.0"),))] == 5
    assert got[("sparecycles_result_age_versions_bucket", (("le", "4.0"),))] == 12
    # Live gauges come from Redis at scrape time: present once, never multiplied by the process count.
    assert got[("sparecycles_workers", (("state", "active"),))] == 3
    assert got[("sparecycles_queue_depth", (("run", "r"),))] == 4


def test_coordinator_with_two_workers_reports_the_sum_over_processes(tmp_path):
    settings = make_settings(tmp_path)
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    (mp_dir / "counter_1.db").write_bytes(b"stale values of an earlier run")  # cleared at start
    port = free_port()
    env = settings_env(settings, PROMETHEUS_MULTIPROC_DIR=str(mp_dir))
    cmd = [sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port), "--log-level", "warning",
           "--workers", "2"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a liveness bound only
        while len(list(mp_dir.glob("counter_*.db"))) < 2 or not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, "coordinator did not start"
            time.sleep(0.1)
        enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
        assert httpx.post(url + "/v1/workers", json={"name": "w"}, headers=enroll).status_code == 201
        # Unauthenticated calls (each on a new connection) until both processes have answered some.
        label = {"reason": "unauthenticated"}
        sent = 0
        while sent < 3000:
            assert httpx.get(url + "/v1/workers").status_code == 401
            sent += 1
            per = _per_process(mp_dir, "sparecycles_rejected_requests_total", label)
            if sent >= 20 and len([v for v in per.values() if v > 0]) == 2:
                break
        assert "counter_1" not in per and len(per) == 2 and all(0 < v < sent for v in per.values()), per
        assert sum(per.values()) == sent
        admin = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
        for _ in range(6):  # whichever process answers the scrape reports the same totals
            got = _samples(httpx.get(url + "/metrics", headers=admin).text)
            assert got[("sparecycles_rejected_requests_total", (("reason", "unauthenticated"),))] == sent
            assert got[("sparecycles_workers", (("state", "active"),))] == 1
        children = _children(proc.pid)
        assert len(children) >= 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cleanup(settings)
    assert proc.returncode == 143  # stopped by SIGTERM (128 + 15, as every long-running command), not by a failing worker (1)
    # No orphan holds the port: the serving processes exit on the parent's signal too. They may still be
    # finishing their shutdown when the parent has been reaped, so allow them a bounded moment.
    deadline = time.monotonic() + 120  # a liveness bound only
    while [pid for pid in children if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if _running(pid)]


def test_serve_processes_refuses_a_port_another_server_shares(tmp_path):
    # SO_REUSEPORT would let a second server join a stale one's port silently; the probe bind refuses it.
    with socket.socket() as stale:
        stale.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        with pytest.raises(OSError):
            serve_processes("api.app:app_from_env", host="127.0.0.1", port=stale.getsockname()[1], workers=2)


def _running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (an exited child waiting to be reaped holds no socket)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").glob("*") for c in (t / "children").read_text().split()]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
