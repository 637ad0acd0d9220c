"""`sparecycles train --coordinator`: a trainer fed by a real coordinator, real Redis and a real worker process.

The fleet-probed runs must log the same losses as the same runs probed in process, bit for bit (ZO-Curv with
--fleet-sync, and a pure-ZO optimizer); the user-facing failures (no coordinator, wrong token, no worker, a
first-order optimizer, missing credentials) exit 2 with a message that says what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from coordinator.keys import Keys
from fleet.backend import BackendTuning
from fleet.collector import READ_BLOCK_MS

REDIS_URL = os.environ.get("SPARECYCLES_TEST_REDIS", "redis://127.0.0.1:6379/0")
# Evaluation stays on the trainer here (--eval-on auto would move it to the fleet: tests/fleet/test_fleet_eval.py).
TINY = ["--preset", "demo", "--batch-size", "4", "--seq-len", "32", "--eval-every", "3", "--no-export",
        "--no-progress", "--eval-on", "trainer"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _losses(run_dir: Path) -> list[tuple[int, str, float]]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in recs for k in ("loss", "val_loss") if k in r]


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator process on the shared Redis (its own key prefix); yields (url, env for clients)."""
    port = _port()
    env = {**os.environ, "SPARECYCLES_REDIS_URL": REDIS_URL, "SPARECYCLES_ADMIN_TOKEN": secrets.token_urlsafe(24),
           "SPARECYCLES_ENROLLMENT_TOKEN": secrets.token_urlsafe(24), "SPARECYCLES_BLOB_DIR": str(tmp_path / "blobs"),
           "SPARECYCLES_KEY_PREFIX": f"tf{secrets.token_hex(4)}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # a liveness bound only: seconds on an idle machine
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
        time.sleep(0.2)
    workers: list[subprocess.Popen] = []
    try:
        yield url, env, workers
    finally:
        for p in [*workers, proc]:
            p.terminate()
        for p in [*workers, proc]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def _start_worker(url: str, env: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 (the child holds it)
    # A worker holds the enrollment token only: its broker URL comes from registration.
    env = {k: v for k, v in env.items() if k not in ("SPARECYCLES_REDIS_URL", "SPARECYCLES_ADMIN_TOKEN")}
    return subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "worker", "--coordinator", url, "--name", "tf-0",
                             "--threads", "1", "--cache-dir", str(tmp_path / "wcache")], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def test_train_coordinator_refuses_clearly_without_a_fleet(tmp_path):
    env = {**os.environ, "SPARECYCLES_ADMIN_TOKEN": "x" * 24, "SPARECYCLES_REDIS_URL": REDIS_URL}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    base = [*TINY, "--steps", "2", "--run-dir", str(tmp_path / "r")]
    res = _cli("train", *base, "--optimizer", "zocurv-line", "--coordinator", f"http://127.0.0.1:{_port()}",
               "--attach-wait", "1", env=env)
    assert res.returncode == 2 and "not reachable" in res.stderr, res.stderr[-2000:]
    res = _cli("train", *base, "--optimizer", "adamw", "--coordinator", "http://127.0.0.1:1", env=env)
    assert res.returncode == 2 and "sends no probes to a fleet" in res.stderr, res.stderr[-2000:]
    res = _cli("train", *base, "--optimizer", "adamw", "--eval-on", "fleet", env=env)
    assert res.returncode == 2 and "--eval-on fleet needs --coordinator" in res.stderr, res.stderr[-2000:]
    bare = {k: v for k, v in env.items() if k not in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL")}
    res = _cli("train", *base, "--optimizer", "1.5spsa", env={**bare, "SPARECYCLES_COORDINATOR_URL": "http://127.0.0.1:1"})
    assert res.returncode == 2 and "SPARECYCLES_ADMIN_TOKEN" in res.stderr, res.stderr[-2000:]
    res = _cli("train", *base, "--optimizer", "1.5spsa", "--coordinator", "http://127.0.0.1:1",
               env={**env, "SPARECYCLES_REDIS_URL": "notaurl"})
    assert res.returncode == 2 and "invalid SPARECYCLES_REDIS_URL" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_train_coordinator_equals_in_process(coordinator, tmp_path):
    url, env, workers = coordinator
    zo = [*TINY, "--optimizer", "zocurv-line", "--steps", "6", "--curvature-interval", "2"]
    # A wrong admin token and an empty fleet: exit 2 with the reason, before anything trains.
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "bad"), "--coordinator", url, "--attach-wait", "2",
               env={**env, "SPARECYCLES_ADMIN_TOKEN": "not-the-token-" + "y" * 16})
    assert res.returncode == 2 and "refused the admin token" in res.stderr, res.stderr[-2000:]
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "bad"), "--coordinator", url, "--attach-wait", "2", env=env)
    assert res.returncode == 2 and "0 of 1 probe worker(s) active" in res.stderr, res.stderr[-2000:]

    workers.append(_start_worker(url, env, tmp_path))
    # A key prefix other than the coordinator's: the trainer would wait on a stream nobody writes. Refused.
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "bad"), "--coordinator", url, "--attach-wait", "60",
               env={**env, "SPARECYCLES_KEY_PREFIX": "not-the-prefix"})
    assert res.returncode == 2 and "no coordinator state under key prefix 'not-the-prefix'" in res.stderr, \
        res.stderr[-2000:]
    # ZO-Curv (zocurv-line, rounds at steps 2 and 4) through the fleet, rounds synchronous; then in process.
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "line-fleet"), "--coordinator", url, "--fleet-sync", env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    assert "1 active worker(s)" in res.stderr
    local = {k: v for k, v in env.items() if k not in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL")}
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "line-local"), env=local)
    assert res.returncode == 0, res.stderr[-3000:]
    fleet, inproc = _losses(tmp_path / "line-fleet"), _losses(tmp_path / "line-local")
    assert fleet == inproc and len(fleet) == 6 + 3  # bit for bit (floats compared exactly)
    # The fleet's folder, by the same command without the fleet: another run (config.json's probe_source), refused.
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "line-fleet"), env=local)
    assert res.returncode == 2 and "probe_source: 'fleet' -> None" in res.stderr, res.stderr[-2000:]
    recs = [json.loads(line) for line in (tmp_path / "line-fleet" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("fleet_results_accepted", 0) for r in recs) > 0  # the worker's results were accepted
    folded = [r["step"] for r in recs if "curv_dropped_rounds" in r]
    assert folded == [r["step"] for r in map(json.loads, (tmp_path / "line-local" / "metrics.jsonl")
                                             .read_text().splitlines()) if "curv_dropped_rounds" in r] and folded

    # A pure-ZO optimizer: every step's probes on the fleet (its update reaches the worker as a ledger entry).
    zo_pure = [*TINY, "--optimizer", "1.5spsa", "--steps", "2", "--probes", "4"]
    res = _cli("train", *zo_pure, "--run-dir", str(tmp_path / "spsa-fleet"), "--coordinator", url, env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    res = _cli("train", *zo_pure, "--run-dir", str(tmp_path / "spsa-local"), env=local)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _losses(tmp_path / "spsa-fleet") == _losses(tmp_path / "spsa-local")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_train_coordinator_zocurv_global_equals_in_process(coordinator, tmp_path):
    """zocurv-global (issue 17's best variant) through the fleet: each refresh publishes θ_t and its ``line`` round
    along θ_t − θ_{t−k} is evaluated by the worker; with --fleet-sync the run equals the in-process one bit for bit."""
    url, env, workers = coordinator
    workers.append(_start_worker(url, env, tmp_path))
    zo = [*TINY, "--optimizer", "zocurv-global", "--steps", "6", "--curvature-interval", "2"]
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "global-fleet"), "--coordinator", url, "--fleet-sync", env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    local = {k: v for k, v in env.items() if k not in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL")}
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "global-local"), env=local)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _losses(tmp_path / "global-fleet") == _losses(tmp_path / "global-local")  # floats compared exactly
    fleet, inproc = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                     for d in ("global-fleet", "global-local"))
    keys = ("line_ratio", "line_curv", "line_slope", "mult_global")
    folded = [(r["step"], *(r[k] for k in keys)) for r in fleet if "line_ratio" in r]
    assert folded == [(r["step"], *(r[k] for k in keys)) for r in inproc if "line_ratio" in r]
    assert [f[0] for f in folded] == [3, 5]  # rounds at steps 2 and 4 (0-based), logged with the step they shaped
    assert max(r.get("line_accepted", 0) for r in fleet) == 2 * 3  # 3 seeds per round, all from the worker
    assert [r["publish_version"] for r in fleet if "publish_unix" in r] == [0, 2, 4]  # inline under --fleet-sync
    # Asynchronous (no --fleet-sync): the trainer publishes at each refresh and steps on; a round is folded at the
    # first step its results have arrived (or dropped past the staleness bound), so only completion is asserted.
    res = _cli("train", *zo, "--run-dir", str(tmp_path / "global-async"), "--coordinator", url, env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "global-async" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["publish_version"]) for r in recs if "publish_version" in r] == [(1, 0), (3, 2), (5, 4)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_coordinator_registers_its_teacher_rounds_for_the_enrolled_workers(coordinator, tmp_path):
    """`train --coordinator URL --teacher T --teacher-rounds REDIS --kd-strict`: the trainer registers its teacher
    run at the coordinator, so a plain enrolled worker (no --teacher-queue) fetches the teacher as blobs and
    answers every step's round: every step taught (none missing), the worker in GET /v1/workers. When the run
    ends its teacher run is ended there too: a worker enrolling afterwards is told of no teacher queue, as of no
    probe queue (the run's evaluation rounds)."""
    from support.models import student_teacher_and_data

    url, env, workers = coordinator
    student, teacher = student_teacher_and_data(tmp_path)
    workers.append(_start_worker(url, env, tmp_path))
    res = _cli("train", "--model", str(student), "--data", str(tmp_path / "data"), "--teacher", str(teacher),
               "--teacher-rounds", env["SPARECYCLES_REDIS_URL"], "--kd-strict", "--kd-window", "2", "--steps", "3",
               "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "0", "--seed", "0", "--optimizer", "adamw",
               "--eval-on", "fleet", "--coordinator", url, "--attach-wait", "120", "--run-dir", str(tmp_path / "run"),
               "--no-progress", "--no-export", env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    assert "registered at" in res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kd"]["kd_taken_steps"] == 3 and summary["kd"]["kd_missing_steps"] == 0
    admin = {"Authorization": f"Bearer {env['SPARECYCLES_ADMIN_TOKEN']}"}
    assert [w["name"] for w in httpx.get(f"{url}/v1/workers", headers=admin, timeout=10).json()] == ["tf-0"]
    enroll = {"Authorization": f"Bearer {env['SPARECYCLES_ENROLLMENT_TOKEN']}"}
    late = httpx.post(f"{url}/v1/workers", json={"name": "late"}, headers=enroll, timeout=10).json()
    assert (late["queues"], late["teacher_queues"]) == ([], []), late


# A stopped trainer's wait for a round gives up within one read of the results stream (fleet.collector.READ_BLOCK_MS);
# then it checkpoints (a demo model: milliseconds) and ends its coordinator run, one HTTP call bounded by the client's
# timeout (BackendTuning.timeout_s). Far below the round timeout (BackendTuning.round_timeout_s, 300 s) that the wait
# ran to before the stop reached it (the first SIGTERM of a fleet-probed run was held 40-57 s). Measured to the
# trainer's own stamp of its stop (its checkpoint's mtime), not to when this test saw the process gone: its exit
# (interpreter teardown) and this test's wake-up are no part of the bound, and stretch on a loaded machine.
STOP_BOUND_S = READ_BLOCK_MS / 1000 + BackendTuning().timeout_s
assert STOP_BOUND_S < BackendTuning().round_timeout_s


def _incomplete(store, keys: Keys, run: str) -> list[str]:
    """The open rounds of `run` that lack results (a completed round stays open until it is stale)."""
    out = []
    for rid in (r.decode() for r in store.smembers(keys.k_run(run, "rounds:open"))):
        done, n = store.hmget(keys.k_round(run, rid), ["done", "n_seeds"])
        if int(done) < int(n):
            out.append(rid)
    return out


def _waiting_round(store, keys: Keys, still_s: float = 2.0, timeout_s: float = 120.0) -> tuple[str, str]:
    """(run, round) of the trainer's coordinator run (the one `train-*` run) once one round of it stays without its
    results for `still_s` seconds: the trainer waits for it (its worker is stopped, so nobody completes it)."""
    deadline, last, since = time.monotonic() + timeout_s, None, 0.0
    while time.monotonic() < deadline:
        runs = [r.decode() for r in store.smembers(keys.k_runs) if r.startswith(b"train-")]
        opened = [(run, rid) for run in runs for rid in _incomplete(store, keys, run)]
        now = opened[0] if len(opened) == 1 else None
        if now != last:
            last, since = now, time.monotonic()
        elif now is not None and time.monotonic() - since >= still_s:
            return now
        time.sleep(0.1)
    raise AssertionError(f"no round of the trainer stayed open for {still_s} s within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_while_the_trainer_waits_for_a_round_stops_it_at_once_and_resumes_the_same_run(coordinator, tmp_path):
    """`train --coordinator --fleet-sync` waiting for a round its (stopped) worker never finishes: one SIGTERM ends it
    within STOP_BOUND_S (before, the wait held the stop until the round came in, or its 300 s timeout) with exit 143
    and the stop line naming the step checkpointed; the checkpoint holds the cut step's round as in flight, with
    the weights it probes; the coordinator run is ended (its open rounds closed, off the runs list). Resumed, with
    the worker going again, the run completes and equals the same run probed in process, bit for bit."""
    import redis

    from trainer.checkpoint import checkpoint_step

    url, env, workers = coordinator
    workers.append(worker := _start_worker(url, env, tmp_path))
    zo = [*TINY, "--optimizer", "zocurv-line", "--steps", "10", "--curvature-interval", "2", "--fleet-sync"]
    run_dir = tmp_path / "fleet"
    argv = [sys.executable, "-m", "sparecycles.cli", "train", *zo, "--run-dir", str(run_dir), "--coordinator", url]
    store, keys = redis.Redis.from_url(REDIS_URL), Keys(env["SPARECYCLES_KEY_PREFIX"], "")
    log = tmp_path / "trainer.log"
    with open(log, "wb") as sink:
        trainer = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.is_file() and any(r[0] >= 4 for r in _losses(run_dir))):  # the round of step 2 folded
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        worker.send_signal(signal.SIGSTOP)  # from here on no round completes
        run, rid = _waiting_round(store, keys)
        before = time.time()
        trainer.send_signal(signal.SIGTERM)
        sent = time.time()  # read after the send: any delay here shortens what is measured, never lengthens it
        trainer.wait(timeout=BackendTuning().round_timeout_s)  # a stop held for the round timeout fails here
    finally:
        trainer.kill()
        worker.send_signal(signal.SIGCONT)
    out = log.read_text()
    # written (tmp + rename) once the wait gave up: the stop's own, as a checkpoint before it is 2 s older or more
    # (_waiting_round saw the trainer wait that long; 1 s covers the file clock's coarse tick)
    written = (run_dir / "checkpoint.safetensors").stat().st_mtime
    took = written - sent
    assert trainer.returncode == 143 and written > before - 1.0 and took < STOP_BOUND_S, (took, out[-3000:])
    m = re.search(r"stopped after step (\d+), checkpointed in (\S+); resume with: (.+)", out)
    assert m and "Traceback" not in out, out[-3000:]
    step = int(m[1])
    assert checkpoint_step(run_dir / "checkpoint.safetensors") == step and rid == f"line-{step}"  # cut in its wait
    with safe_open(str(run_dir / "checkpoint.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["sparecycles"])["meta"]["mode"]
    assert [r["round_id"] for r in meta["curvature"]["inflight"]] == [rid] and step in meta["round_weights"]
    assert run.encode() not in store.smembers(keys.k_runs) and not store.smembers(keys.k_run(run, "rounds:open"))
    assert store.hget(keys.k_round(run, rid), "state") == b"closed"  # ended: no worker evaluates it any more

    res = _cli("train", *zo, "--run-dir", str(run_dir), "--coordinator", url, "--resume", env=env)
    assert res.returncode == 0, res.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    local = {k: v for k, v in env.items() if k not in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL")}
    res = _cli("train", *zo[:-1], "--run-dir", str(tmp_path / "local"), env=local)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _losses(run_dir) == _losses(tmp_path / "local") and len(_losses(run_dir)) == 10 + 5
