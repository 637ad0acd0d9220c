"""probe_worker.priority: the task thread's nice and policy, and the process's Linux autogroup, which decides how a
core is shared with an engine of another session (sched(7)). Real processes and real /proc, no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from probe_worker.options import WorkerOptions
from probe_worker.priority import AUTOGROUP_SWITCH, lower_session_priority, lower_thread_priority
from support.paths import ROOT

AUTOGROUPS = AUTOGROUP_SWITCH.exists() and AUTOGROUP_SWITCH.read_text().strip() == "1"
needs_autogroups = pytest.mark.skipif(not AUTOGROUPS, reason="kernel.sched_autogroup_enabled is not 1 here")

# A child that lowers its autogroup (unless argv[1] == "0"), prints "ready", reads a time.monotonic() reading from
# stdin (one clock for every process of the host) and spins until then, then prints JSON: why not (None: done), its
# loops, its /proc/self/autogroup, and whether it leads its session.
CHILD = """
import json, os, sys, time
from probe_worker.priority import lower_session_priority
why = lower_session_priority(int(sys.argv[1])) if sys.argv[1] != "0" else None
print("ready", flush=True)
end, n = float(sys.stdin.readline()), 0
while time.monotonic() < end:
    n += 1
print(json.dumps([why, n, open("/proc/self/autogroup").read().strip(), os.getsid(0) == os.getpid()]), flush=True)
"""


def _child(nice: int, cpu: int | None = None, **popen) -> subprocess.Popen:
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    proc = subprocess.Popen([*pin, sys.executable, "-c", CHILD, str(nice)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc: subprocess.Popen, end: float = 0.0) -> subprocess.Popen:
    """Tell a ready child when to stop spinning (a time.monotonic() reading)."""
    proc.stdin.write(f"{end!r}\n")
    proc.stdin.flush()
    return proc


def _report(proc: subprocess.Popen) -> tuple[str | None, int, str, bool]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return tuple(json.loads(out))


def test_lower_thread_priority_lowers_the_calling_thread_only():
    seen = {}

    def task_thread():
        lower_thread_priority(19, True)
        child = threading.Thread(target=lambda: seen.update(child=(os.getpriority(os.PRIO_PROCESS, 0),
                                                                   os.sched_getscheduler(0))))
        child.start()
        child.join()
        seen["task"] = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))

    before = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
    t = threading.Thread(target=task_thread)
    t.start()
    t.join()
    assert seen["task"] == (19, os.SCHED_IDLE) and seen["child"] == (19, os.SCHED_IDLE)  # inherited
    assert (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)) == before  # this thread untouched


@needs_autogroups
def test_only_a_session_leader_lowers_its_autogroup_and_never_its_starters():
    mine = Path("/proc/self/autogroup").read_text()  # "" where this session is init's root group (CI runners)
    why, _, group, leader = _report(_go(_child(19, start_new_session=True)))  # as up and bench serving start it
    assert why is None and leader and group.endswith("nice 19")
    for popen in ({}, {"process_group": 0}):  # a script's child; a shell's job: both share the starter's session
        why, _, group, leader = _report(_go(_child(19, **popen)))
        assert "setsid -w" in why and not leader and group == mine.strip()  # and it stays in reach of Ctrl-C
    assert Path("/proc/self/autogroup").read_text() == mine  # the starter's session keeps its nice


def test_refusals_without_autogroups_and_out_of_range(tmp_path):
    off = tmp_path / "switch"
    off.write_text("0\n")
    assert "autogroups are off" in lower_session_priority(19, switch=off)
    assert "no autogroups" in lower_session_priority(19, switch=tmp_path / "absent")
    on, empty = tmp_path / "on", tmp_path / "empty"
    on.write_text("1\n")
    empty.write_text("")
    code = ("import sys; from pathlib import Path; from probe_worker.priority import lower_session_priority as f; "
            "print(f(19, switch=Path(sys.argv[1]), own=Path(sys.argv[2])))")
    leader = subprocess.run([sys.executable, "-c", code, str(on), str(empty)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            timeout=60, check=True)  # a session leader gets as far as reading its autogroup
    assert "in no autogroup" in leader.stdout and empty.read_text() == ""
    for bad in (0, 20, -1):
        with pytest.raises(ValueError, match="1-19"):
            lower_session_priority(bad)


@needs_autogroups
def test_the_lowered_session_leaves_the_core_to_another_sessions_spinner():
    """The property it exists for: two spinners of separate sessions pinned to one core; the one whose autogroup is
    at nice 19 gets a small share (measured here: 1.6%), where a thread nice alone leaves it half (docs/serving.md).
    The bound, under a fifth, is far from both. Both spin until one end on the host's monotonic clock, from when
    each read it: neither spins alone after the other stopped (a child that starts late on a loaded machine spun
    alone and won the loops), and a worker woken late by its low share only spins less."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    engine = _child(0, cpu=cpu, start_new_session=True)  # each started and lowered: "ready"
    worker = _child(19, cpu=cpu, start_new_session=True)
    end = time.monotonic() + 2.0
    _go(engine, end), _go(worker, end)
    (_, engine_loops, _, _), (why, worker_loops, group, _) = _report(engine), _report(worker)
    assert why is None and group.endswith("nice 19")
    assert worker_loops < 0.2 * engine_loops, (worker_loops, engine_loops)


def test_a_worker_beside_an_engine_runs_its_tasks_at_nice_19_unless_told():
    base = {"coordinator": "http://127.0.0.1:8000", "token": "t"}
    serving = {"serving": {"metrics_url": "http://127.0.0.1:8000/load"}}
    assert WorkerOptions(**base).task_nice == 0
    assert WorkerOptions(**base, **serving).task_nice == 19
    assert WorkerOptions(**base, **serving, nice=0).task_nice == 0
    assert WorkerOptions(**base, nice=5).task_nice == 5
