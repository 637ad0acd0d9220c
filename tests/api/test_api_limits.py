"""Issue 14 case 1: request bodies are bounded and authenticated before they are read.

A real coordinator process (uvicorn, the `app_from_env` factory) on the shared Redis: an unauthenticated
64 MiB body is refused with 401 and an over-limit body with 413 (declared and chunked), without the
process's peak memory growing by the body sizes; refusals are counted.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.server import free_port
from support.coordinator import REDIS_URL, cleanup, make_settings

MIB = 1 << 20


def _vm_hwm_kib(pid: int) -> int:
    """Peak resident set size of process `pid` (VmHWM, KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _post_raw(port: int, path: str, token: str | None, total: int, chunked: bool) -> tuple[int, bytes, int]:
    """POST `total` bytes to `path`, sending until the server answers; returns (status, body, bytes sent).

    Raw socket so the client keeps pushing while the server has already refused (as an attacker would).
    """
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    piece = b"[" + b"1," * (64 * 1024)
    frame = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") if chunked else piece
    sent, reply = 0, b""
    s.setblocking(False)
    deadline = time.monotonic() + 60
    while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
        readable, writable, _ = select.select([s], [s] if sent < total else [], [], 1.0)
        if readable:
            data = s.recv(65536)
            if not data:
                break
            reply += data
        elif writable:
            try:
                sent += s.send(frame)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
    s.setblocking(True)
    s.settimeout(5)
    head_end = reply.find(b"\r\n\r\n")
    assert head_end >= 0, "no response"
    with_body = reply
    try:
        while True:
            data = s.recv(65536)
            if not data:
                break
            with_body += data
            if with_body.endswith(b"}"):
                break
    except OSError:
        pass
    s.close()
    status = int(reply.split(b" ", 2)[1])
    return status, with_body[head_end + 4 :], sent


@pytest.fixture
def coordinator_process(tmp_path):
    settings = make_settings(tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "SPARECYCLES_REDIS_URL": REDIS_URL,
        "SPARECYCLES_KEY_PREFIX": settings.key_prefix,
        "SPARECYCLES_QUEUE_PREFIX": settings.queue_prefix,
        "SPARECYCLES_ADMIN_TOKEN": settings.admin_token.get_secret_value(),
        "SPARECYCLES_ENROLLMENT_TOKEN": settings.enrollment_token.get_secret_value(),
        "SPARECYCLES_BLOB_DIR": str(tmp_path / "blobs"),
        "SPARECYCLES_MAX_BODY_BYTES": str(64 * 1024),
    }
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        yield proc, port, settings
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        cleanup(settings)


def test_large_bodies_are_refused_before_they_are_read(coordinator_process):
    proc, port, settings = coordinator_process
    url = f"http://127.0.0.1:{port}"
    enroll = settings.enrollment_token.get_secret_value()
    # Warm the process (first requests allocate pools, schemas): the peak is taken after this.
    for _ in range(3):
        assert httpx.post(f"{url}/v1/workers", json={"name": "x" * 300}).status_code == 401
    hwm_before = _vm_hwm_kib(proc.pid)

    status, body, _ = _post_raw(port, "/v1/workers", None, 64 * MIB, chunked=False)
    assert status == 401 and b"bearer token" in body
    status, body, _ = _post_raw(port, "/v1/workers", "w-0123456789abcdef.forged", 64 * MIB, chunked=True)
    assert status == 401 and b"unknown token" in body
    status, body, _ = _post_raw(port, "/v1/workers", enroll, 64 * MIB, chunked=False)
    assert status == 413 and b"65536 bytes" in body and b"SPARECYCLES_MAX_BODY_BYTES" in body
    status, body, _ = _post_raw(port, "/v1/workers", enroll, 64 * MIB, chunked=True)
    assert status == 413 and b"SPARECYCLES_MAX_BODY_BYTES" in body
    # 4 x 64 MiB offered; the process read at most its limit and socket buffers of each.
    assert _vm_hwm_kib(proc.pid) - hwm_before < 16 * 1024

    # A normal registration still works on the same process, and the refusals are counted.
    ok = httpx.post(
        f"{url}/v1/workers", json={"name": "w"}, headers={"Authorization": f"Bearer {enroll}"}, timeout=10
    )
    assert ok.status_code == 201, ok.text
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'sparecycles_rejected_requests_total{reason="body_too_large"} 2.0' in text


def test_results_route_has_its_own_limit_and_role_caps_it(tmp_path):
    from support.coordinator import running_env

    gen = running_env(tmp_path, max_results_body_bytes=4096, max_body_bytes=1024)
    env = next(gen)
    try:
        reg, worker = env.enroll("w")
        run = "lim" + secrets.token_hex(3)
        env.create_run(run)
        small = {
            "results": [
                {
                    "run": run,
                    "round_id": "r",
                    "seed": 1,
                    "version": 0,
                    "worker_id": reg["worker_id"],
                    "l_plus": 1.0,
                    "l_minus": 2.0,
                }
            ]
        }
        resp = worker.post(f"/v1/runs/{run}/results", json=small)  # ~200 bytes > max_body_bytes is fine
        assert resp.status_code == 200 and resp.json()["outcomes"] == ["unknown_round"]
        big = {"results": small["results"] * 40}  # ~5 KB
        resp = worker.post(f"/v1/runs/{run}/results", json=big)
        assert resp.status_code == 413 and "SPARECYCLES_MAX_RESULTS_BODY_BYTES" in resp.json()["detail"]

        def chunks():
            yield b'{"results": ['
            for _ in range(100):
                yield b'{"run": "x"},' * 10

        resp = worker.post(f"/v1/runs/{run}/results", content=chunks())  # no Content-Length
        assert resp.status_code == 413
        # A worker's heartbeat is capped by max_body_bytes even though the results limit is larger.
        resp = worker.post(f"/v1/workers/{reg['worker_id']}/heartbeat", content=b" " * 2000)
        assert resp.status_code == 413 and "SPARECYCLES_MAX_BODY_BYTES" in resp.json()["detail"]
        # An admin's round document may be larger than a worker's body.
        resp = env.admin.post(f"/v1/runs/{run}/rounds", content=b" " * 2000)
        assert resp.status_code == 422
    finally:
        gen.close()
