"""No engine outlives its starter: a process started by probe_worker.engine.VllmProcess (here one whose command is
`sleep`, through the same `taskset` + exec path) is stopped when the process that started it is SIGKILLed
(PR_SET_PDEATHSIG, probe_worker.engine.die_with_parent), as `up`'s own children are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.paths import ROOT

STARTER = """
import sys, time
from pathlib import Path
from probe_worker.engine import VllmProcess

class Sleeper(VllmProcess):
    def command(self):
        return ["sleep", "300"]

engine = Sleeper(Path("."), 9, Path(sys.argv[1]), cpus=[0])
engine.start()
print(engine.proc.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; its reaper may be slow


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_dies_when_its_starter_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / "engine.log")], env=env,
                               stdout=subprocess.PIPE, text=True)
    child = int(starter.stdout.readline())
    try:
        assert _alive(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait(30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the engine outlived the process that started it"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_engine_child_starts_with_the_drain_signals_unblocked():
    """A worker holds SIGUSR1/SIGUSR2 (probe_worker.drain_signals); an engine it starts gets a fresh process's mask."""
    code = """
import signal, subprocess, sys
from probe_worker.drain_signals import hold_drain_signals
from probe_worker.engine import die_with_parent
hold_drain_signals()
read = [sys.executable, "-c", "print([l for l in open('/proc/self/status') if l.startswith('SigBlk')][0])"]
print(subprocess.run(read, capture_output=True, text=True).stdout.strip())
print(subprocess.run(read, capture_output=True, text=True, preexec_fn=die_with_parent).stdout.strip())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout.split("\n")
    usr = (1 << (signal.SIGUSR1 - 1)) | (1 << (signal.SIGUSR2 - 1))
    inherited, engine = (int(line.split(":")[1], 16) for line in out[:2])
    assert inherited & usr == usr and engine & usr == 0
