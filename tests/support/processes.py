"""End-to-end process helpers: start `sparecycles up` and list the processes it left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def processes_of(run_dir: Path) -> list[str]:
    """Command lines of live processes started for `run_dir`: they inherit SPARECYCLES_UP_RUN, or (Valkey,
    whose process title overwrites its environment block) run inside the run folder."""
    root = run_dir.resolve()
    marker = f"SPARECYCLES_UP_RUN={root}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            inherited = marker in (proc / "environ").read_bytes().split(b"\0")
            if not inherited and not Path(os.readlink(proc / "cwd")).is_relative_to(root):
                continue
            found.append(proc.name + ": " + (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def start_up(run_dir: Path, *args: str) -> subprocess.Popen:
    """Start `sparecycles up --run-dir run_dir --no-progress *args` (embedded Valkey: REDIS_URL unset), output
    piped; the caller waits for it (or sends SIGINT) and then checks `processes_of(run_dir) == []`."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # exercise the embedded Valkey
    return subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "up", "--run-dir", str(run_dir),
                             "--no-progress", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
