"""Real enrolled workers answering teacher rounds (`sparecycles worker`, its teacher round kind) on the test Redis,
for the teacher-round tests: one coordinator process per test session and Redis (started at the first worker,
stopped at exit), each worker a process of its own group enrolled there, the queue it answers registered as a
teacher run (POST /v1/teachers) so it is in the workers' queue list, as `sparecycles up` registers its runs'."""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from support.fleet import ROOT, Fleet
from wire.teacher_messages import TEACHER_QUEUE_PREFIX

_FLEETS: dict[str, Fleet] = {}
_RUNS: dict[int, str] = {}  # worker pid -> the teacher run registered for it


class _TeacherCoordinator(Fleet):
    """A Fleet's coordinator process on `redis_url` (the tests' Redis), no workers of its own."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        super().__init__(Path(tempfile.mkdtemp(prefix="sc-teacher-fleet-")))
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)  # close() deletes this fleet's keys there

    def start_coordinator(self) -> None:
        self.env.update(SPARECYCLES_REDIS_URL=self.redis_url)
        super().start_coordinator()


def coordinator_of(redis_url: str) -> Fleet:
    """The session's coordinator on `redis_url` (started at its first use)."""
    if redis_url not in _FLEETS:
        _FLEETS[redis_url] = _TeacherCoordinator(redis_url)
        atexit.register(_FLEETS[redis_url].close)
    return _FLEETS[redis_url]


def _register(fleet: Fleet, queue: str) -> str:
    """Register the teacher run of `queue` (a placeholder teacher: the rounds name a folder the worker reads)."""
    run = queue.removeprefix(TEACHER_QUEUE_PREFIX + ".")
    config = b"{}"
    sha = hashlib.sha256(config).hexdigest()
    assert fleet.admin.put(f"/v1/blobs/{sha}", content=config).status_code == 201
    teacher = {"teacher_sha256": hashlib.sha256(run.encode()).hexdigest(),
               "files": [{"name": "config.json", "size": len(config), "sha256": sha}]}
    resp = fleet.admin.post("/v1/teachers", json={"run": run, "teacher": teacher})
    assert resp.status_code == 201, resp.text
    return run


def start_teacher_worker(redis_url: str, queue: str, pause_s: float = 0.0,
                         env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """An enrolled worker (`python -m probe_worker.cli`) answering the teacher rounds of `queue` (registered at the
    session's coordinator on `redis_url`), in its own process group, on one CPU thread: the in-process reference
    then sums in the same order. `pause_s` > 0: it holds each round that long first (a redelivery test kills it
    meanwhile). `env`: variables set on top of the fleet's (e.g. SPARECYCLES_CACHE, where it keeps teachers
    fetched from the coordinator); `args`: more worker options (e.g. --teacher-engine URL)."""
    fleet = coordinator_of(redis_url)
    run = _register(fleet, queue)
    if "--teacher-engine" in args or pause_s:  # --teacher-pause holds the rounds of a queue it names
        args = (*args, "--teacher-queue", queue)
    if pause_s:
        args = (*args, "--teacher-pause", str(pause_s))
    cmd = [sys.executable, "-m", "probe_worker.cli", "--coordinator", fleet.url, "--token", fleet.enroll_token,
           "--name", f"teacher-{run}", "--control-interval", "0.25", "--soft-shutdown", "5", "--threads", "1",
           "--cache-dir", str(fleet.tmp / f"cache-{run}"), *args]
    log_path = fleet.tmp / f"teacher-{run}-{len(_RUNS)}.log"
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, env={**fleet.env, **(env or {})}, cwd=ROOT, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path  # type: ignore[attr-defined] - the worker's log, for tests that read it
    _RUNS[proc.pid] = run
    return proc


def stop_teacher_worker(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (its warm shutdown), SIGKILL after 30 s; its teacher run ended at the
    coordinator (later workers do not consume its queue)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    run = _RUNS.pop(proc.pid, None)
    if run is not None and not any(r == run for r in _RUNS.values()):
        for fleet in _FLEETS.values():
            fleet.admin.post(f"/v1/teachers/{run}/end")
