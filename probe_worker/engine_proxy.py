"""A load proxy in front of a serving engine whose own gauges move late (llama.cpp's server, SGLang): every request is
forwarded to the engine, and `GET /load` answers as vLLM's does with `--enable-server-load-tracking`
(`{"server_load": N}`), N the requests the proxy holds, counted from the moment its handler is entered (before the
engine reads a byte) until the engine's answer has finished streaming back. A yielding worker reads it as it reads
vLLM's /load (probe_worker.serving.EngineProbe, server_load).

What it is: a plain ASGI app (no framework: the handler's own call spans the whole exchange, so the count cannot end
before the stream does) served by uvicorn, with one httpx.AsyncClient to the engine. Requests are passed through
with their method, path, query, body and headers (hop-by-hop headers dropped); the engine's status, headers and body
come back unchanged, its body chunk by chunk as it arrives (server-sent events stay streamed). Its own answers:
- 502 `{"error": ...}`: the engine refused the connection or broke the HTTP protocol before its status line;
- 504 `{"error": ...}`: no connection within `connect_timeout_s`, or no status line within `read_timeout_s`;
- a body cut short (the connection closed without the final chunk) when the engine stops or stalls for
  `read_timeout_s` mid-stream: a client can tell it from a complete answer.
A client that disconnects mid-stream closes the proxy's upstream connection too (llama.cpp then stops that request).
`sparecycles engine-proxy --upstream URL --port P` serves it (SIGINT/SIGTERM: uvicorn's graceful shutdown, streams in
flight get `shutdown_grace_s`, then the upstream client is closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("sparecycles.engine_proxy")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx/uvicorn set themselves: never passed through.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})


class ProxyOptions(BaseModel):
    """`engine-proxy`'s options. Raises pydantic.ValidationError naming the field for a value out of bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    upstream: str = Field(..., pattern=r"^https?://[^/\s]+(/[^\s]*)?$", description="the engine's base URL, "
                          "e.g. http://127.0.0.1:8080 (every request's path is appended to it)")
    host: str = Field("127.0.0.1", min_length=1, description="interface to bind")
    port: int = Field(..., ge=1, le=65535, description="TCP port to serve on")
    connect_timeout_s: float = Field(5.0, gt=0, le=600, description="seconds to connect to the engine (else 504)")
    read_timeout_s: float = Field(600.0, gt=0, le=86400, description="seconds the engine may stay silent: before "
                                  "its status line (else 504) and between two chunks of a body (else the body is "
                                  "cut short)")
    shutdown_grace_s: float = Field(5.0, ge=0, le=600, description="on SIGINT/SIGTERM, seconds streams in flight "
                                    "get to finish")
    log_level: str = Field("warning", pattern=r"^(critical|error|warning|info|debug)$", description="uvicorn's "
                           "log level")


class EngineProxy:
    """The ASGI app. `held`: requests inside a forwarding handler now (what /load answers); `served`: forwarded
    requests ended so far (any outcome). One event loop: both are plain ints."""

    def __init__(self, upstream: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.held = 0
        self.served = 0
        self._client = None  # httpx.AsyncClient, made at startup in the serving loop

    def _make_client(self):
        import httpx

        connect, read = self.timeout
        return httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(read, connect=connect),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["path"] == "/load" and scope["method"] == "GET":
                await _answer(send, 200, {"server_load": self.held})
                return
            self.held += 1  # first statement of the handler: the request counts before anything is awaited
            try:
                await self._forward(scope, receive, send)
            finally:
                self.held -= 1
                self.served += 1
        # websockets: not served (uvicorn answers 403 when the app returns without accepting)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._client = self._make_client()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: dict, receive, send) -> None:
        import httpx

        if self._client is None:  # served without a lifespan (a test's bare ASGI call)
            self._client = self._make_client()
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP_BY_HOP]
        request = self._client.build_request(scope["method"], path, headers=headers, content=body)
        try:
            reply = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            await _answer(send, 504, {"error": f"the engine did not answer in time ({type(exc).__name__})"})
            return
        except httpx.HTTPError as exc:
            await _answer(send, 502, {"error": f"the engine at {self.upstream} failed: {type(exc).__name__}: {exc}"})
            return
        try:
            await self._stream_back(reply, receive, send)
        finally:
            await reply.aclose()

    async def _stream_back(self, reply, receive, send) -> None:
        """The engine's status, headers and body, chunk by chunk; stops early when the client goes away. An engine
        that fails mid-body raises (uvicorn then closes the connection: the client sees a cut body, not an end)."""
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.multi_items()
                   if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": reply.status_code, "headers": headers})
        gone = asyncio.create_task(_wait_disconnect(receive))
        try:
            async for chunk in reply.aiter_raw():
                if gone.done():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as exc:
            log.warning("engine proxy: the engine's answer broke off: %s: %s", type(exc).__name__, exc)
            raise
        finally:
            gone.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_body(receive) -> tuple[bytes, bool]:
    """The request's whole body (requests to an engine are small JSON), and whether the client left first."""
    parts = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"", True
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts), False


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _answer(send, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def serve(options: ProxyOptions) -> None:
    """Serve the proxy until SIGINT/SIGTERM (uvicorn; one process, one event loop)."""
    import uvicorn

    app = EngineProxy(options.upstream, options.connect_timeout_s, options.read_timeout_s)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level, access_log=False,
                lifespan="on", timeout_graceful_shutdown=options.shutdown_grace_s)
