"""End-to-end process helpers: start `sparecycles up` and list the processes it left behind."""

from __future__ import annotations

import os
import signal
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


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_up(run_dir: Path, *args: str, sigint_ignored: bool = False) -> subprocess.Popen:
    """Start `sparecycles up --run-dir run_dir --no-progress *args` (embedded Valkey: REDIS_URL unset), output
    piped; the caller waits for it (or sends SIGINT) and then checks `processes_of(run_dir) == []`.
    `sigint_ignored`: start it with SIGINT ignored, as a shell without job control starts a background command
    (`up &` in a script; a CI job run that way): its Ctrl-C handling must not depend on the inherited disposition."""
    return start_cli(["up", "--run-dir", str(run_dir), "--no-progress", *args], sigint_ignored=sigint_ignored)


def start_cli(args: list[str], *, sigint_ignored: bool = False) -> subprocess.Popen:
    """Start `sparecycles ARGS` (embedded Valkey for `up`: REDIS_URL unset), stdout and stderr piped together."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # exercise the embedded Valkey
    return subprocess.Popen([sys.executable, "-m", "sparecycles.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=_ignore_sigint if sigint_ignored else None)


def read_until(proc: subprocess.Popen, words: str, seen: list[str]) -> None:
    """Read `proc`'s output line by line into `seen` until a line holds `words`; AssertionError if it exits first."""
    for raw in proc.stdout:
        seen.append(raw.decode(errors="replace"))
        if words in seen[-1]:
            return
    raise AssertionError(f"exited ({proc.wait()}) before printing {words!r}:\n" + "".join(seen)[-3000:])
