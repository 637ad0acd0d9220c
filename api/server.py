"""Run the API under uvicorn in a background thread (embedded `up`, benches, integration tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """A real uvicorn server for `app` on `host:port` (port 0 picks a free one), in a daemon thread.

    Use as a context manager; `url` is the base URL. Raises RuntimeError if it does not start within
    `start_timeout_s` seconds.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 20.0,
        log_level: str = "warning",
    ) -> None:
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn:{self.port}", daemon=True)
        self.start_timeout_s = start_timeout_s

    def start(self) -> ServerThread:
        """Start serving; returns once uvicorn reports it is listening."""
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
