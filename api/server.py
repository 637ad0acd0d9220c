"""Run the API under uvicorn: in a background thread (benches, integration tests), or as several
processes sharing a port (`sparecycles coordinator --workers N`)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from typing import Any, Self

import uvicorn
from fastapi import FastAPI

from coordinator.settings import CoordinatorSettings


def settings_env(settings: CoordinatorSettings, **extra: str) -> dict[str, str]:
    """os.environ plus the variables from which a coordinator process started with it reads `settings` back
    (state Redis, key and queue prefixes, blob directory, admin and enrollment tokens), and `extra`;
    SPARECYCLES_REDIS_URL is dropped so that REDIS_URL is the one read."""
    env = dict(
        os.environ,
        REDIS_URL=settings.redis_url,
        SPARECYCLES_KEY_PREFIX=settings.key_prefix,
        SPARECYCLES_QUEUE_PREFIX=settings.queue_prefix,
        SPARECYCLES_BLOB_DIR=str(settings.blob_dir),
        SPARECYCLES_ADMIN_TOKEN=settings.admin_token.get_secret_value(),
        SPARECYCLES_ENROLLMENT_TOKEN=settings.enrollment_token.get_secret_value(),
        **extra,
    )
    env.pop("SPARECYCLES_REDIS_URL", None)
    return env


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


def serve_processes(app: str, *, host: str, port: int, workers: int, **uvicorn_options: Any) -> int:
    """Serve the ASGI app import string `app` from `workers` uvicorn processes, each accepting on its own
    SO_REUSEPORT listener of `host:port` (Linux spreads new connections over them by address hash).

    uvicorn's own `workers` shares one listening socket: a burst of connections (every worker of a fleet
    reconnecting at once) goes to whichever process wakes first, and keep-alive connections stay
    there: in the intake bench one of two processes often served nearly all 64 workers. `uvicorn_options` go to
    `uvicorn.Config` (e.g. `factory=True`, `log_level`). Stops every process on SIGINT/SIGTERM, or
    when one exits (a service manager restarts the whole); returns 128 + the signal after one (130 after Ctrl-C, 143
    after SIGTERM, as the other long-running commands end), 1 otherwise.
    Raises OSError if `host:port` is already taken (checked without SO_REUSEPORT, which would
    otherwise silently share the port with a stale server).
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads or sockets
    procs = [
        ctx.Process(target=_serve_one, args=(app, family, addr, uvicorn_options)) for _ in range(workers)
    ]
    stop, signals = threading.Event(), []

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.start()
        while not stop.is_set() and all(p.is_alive() for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn's graceful shutdown
        for p in procs:
            p.join(timeout=uvicorn_options.get("timeout_graceful_shutdown", 10) + 5)
            if p.is_alive():
                p.kill()
                p.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + signals[0] if signals else 1


def _serve_one(app: str, family: int, addr: tuple, options: dict[str, Any]) -> None:
    # One worker process: its own listener in the SO_REUSEPORT group, then a plain uvicorn server on it.
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.listen(2048)
    uvicorn.Server(uvicorn.Config(app, host=addr[0], port=addr[1], **options)).run(sockets=[sock])
