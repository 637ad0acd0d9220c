"""The simulated workers of `sparecycles bench intake`'s http mode (benchmarks.intake): a lean HTTP/1.1 keep-alive
client per worker and the asyncio loop that posts result batches through them, closed or open loop."""

from __future__ import annotations

import asyncio
import json
import time

import httpx


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client for the load generator (one connection, one request at a time).

    The simulated workers share the bench machine's cores with the coordinator; httpx costs more CPU per
    request than the server does, so a lean client keeps the measurement about the server. Raises
    RuntimeError on a non-2xx status or a response without Content-Length.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n".encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post_json(self, path: str, body: bytes) -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode()
        self.writer.write(head + self.auth + b"\r\n" + body)
        status_line = await self.reader.readline()
        length = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise RuntimeError(f"response without Content-Length: {status_line!r}")
        payload = await self.reader.readexactly(length)
        if not status_line.split()[1].startswith(b"2"):
            raise RuntimeError(f"{status_line!r}: {payload[:200]!r}")
        return payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


async def post_results(
    url: str, run: str, tokens: list[tuple[str, str]], jobs: list[tuple[str, list[int]]], rate: float
):
    """Post result batches of run `run` (`jobs`: (round id, seeds) each) from one simulated worker per
    (worker id, token) of `tokens`, each over its own keep-alive connection; returns (accepted results, seconds,
    latency in ms per result). Closed loop (rate 0: each worker posts as soon as its previous post returns) or
    open loop at `rate` results/s in total. Open-loop latency counts from the scheduled send time, so a server falling
    behind shows up in the figures (no coordinated omission)."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    lat: list[float] = []
    accepted = 0
    interval = len(tokens) * len(jobs[0][1]) / rate if rate > 0 else 0.0
    host, port = httpx.URL(url).host, httpx.URL(url).port
    clients = [KeepAliveClient(host, port, t) for _, t in tokens]
    await asyncio.gather(*(c.connect() for c in clients))  # connected before the clock starts
    start = time.perf_counter() + 0.05

    async def worker(k: int, wid: str, c: KeepAliveClient) -> None:
        nonlocal accepted
        n = 0
        while not queue.empty():
            rid, seeds = queue.get_nowait()
            results = [
                {
                    "run": run,
                    "round_id": rid,
                    "seed": s,
                    "version": 0,
                    "worker_id": wid,
                    "l_plus": 1.0,
                    "l_minus": 2.0,
                }
                for s in seeds
            ]
            t0 = time.perf_counter()
            if interval:
                t0 = start + (n + k / len(tokens)) * interval  # staggered, evenly spaced sends
                n += 1
                await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
            reply = await c.post_json(f"/v1/runs/{run}/results", json.dumps({"results": results}).encode())
            dt = (time.perf_counter() - t0) * 1e3
            accepted += json.loads(reply)["outcomes"].count("accepted")
            lat.extend([dt] * len(seeds))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(k, w, c) for k, ((w, _), c) in enumerate(zip(tokens, clients))))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    return accepted, time.perf_counter() - t0, lat


def loop_factory():
    """uvloop's event loop for the simulated workers if installed (uvicorn[standard] brings it): less
    client CPU taken from the cores the coordinator and Redis run on."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
