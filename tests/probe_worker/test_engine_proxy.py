"""The engine load proxy (probe_worker.engine_proxy, `sparecycles engine-proxy`) in front of a real HTTP engine, the
stand-in (benchmarks.serving_standin: one request at a time, FIFO): its /load counts a request from arrival, while
the engine has not answered a token of it, until its stream has ended; what streams through is what the engine
streams directly; an engine that is not there is a 502, not a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from api.server import free_port
from benchmarks.serving_standin import StandinProcess
from probe_worker.engine_proxy import ProxyOptions
from probe_worker.serving import EngineProbe, ServingPolicy
from support.standin import CONFIG


@contextmanager
def proxy(upstream: str, *extra: str):
    """`sparecycles engine-proxy` as a child process; yields its base URL once /load answers; SIGTERM after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "engine-proxy", "--upstream", upstream,
                             "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a liveness bound only (an import of the CLI on a loaded machine)
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/load", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the proxy did not answer /load"
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        # a clean shutdown: uvicorn's graceful one, which then re-raises the SIGTERM it caught (uvicorn >= 0.29)
        assert proc.returncode in (0, -signal.SIGTERM) and b"Traceback" not in out, out.decode()


def _stream(client: httpx.Client, url: str, body: dict, out: list) -> None:
    with client.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                out.append((time.monotonic(), line))


def test_proxy_counts_a_request_from_arrival_to_the_end_of_its_stream(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    engine = StandinProcess(tmp_path, free_port(), tmp_path / "engine.log",
                            extra_args=["--config", str(tmp_path / "config.json"), "--threads", "1"])
    body = {"model": "standin", "prompt": "in the beginning was the word", "max_tokens": 12, "stream": True}
    with engine, proxy(engine.url) as url, httpx.Client(timeout=300) as client:
        load = EngineProbe(ServingPolicy(metrics_url=url + "/load"))  # the worker's own reader of /load
        assert load.read() == 0.0
        direct: list = []
        _stream(client, engine.url, body, direct)
        # The engine serves one request at a time: a long one sent to it directly holds the engine, so the
        # request sent through the proxy next gets no token until the long one has ended.
        hold = threading.Thread(target=client.post, args=(engine.url + "/v1/completions",),
                                kwargs={"json": {"prompt": "hold", "max_tokens": 1500}})
        hold.start()
        while httpx.get(engine.url + "/load", timeout=10).json()["server_load"] < 1:
            time.sleep(0.01)
        via: list = []
        th = threading.Thread(target=_stream, args=(client, url, body, via))
        th.start()
        seen = []  # (time, proxy /load) until the proxied stream ends
        while th.is_alive():
            seen.append((time.monotonic(), load.read()))
        th.join()
        hold.join()
        first_one = min(t for t, v in seen if v == 1.0)
        assert first_one < via[0][0]  # counted while the engine had answered none of its tokens
        assert {v for _, v in seen} <= {0.0, 1.0}
        assert [line for _, line in via] == [line for _, line in direct]  # the engine's stream, unchanged
        assert len(via) == 13 and via[-1][1] == "data: [DONE]"
        # released once its stream has ended (the handler counts it off just after the last chunk; wait for that)
        deadline = time.monotonic() + 60
        while load.read() != 0.0:
            assert time.monotonic() < deadline, "the proxy still counts a finished request"
            time.sleep(0.02)
        # a plain GET passes through too, and leaves the count at 0
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "standin"
        assert load.read() == 0.0
        load.close()


def test_proxy_answers_502_for_an_engine_that_is_not_there_and_counts_it_off():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with proxy(dead, "--connect-timeout-s", "2") as url:
        reply = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert reply.status_code == 502 and "ConnectError" in reply.json()["error"]
        assert httpx.get(url + "/load", timeout=10).json() == {"server_load": 0}


def test_proxy_options_refuse_a_bad_upstream_or_port():
    import pydantic

    for bad in ({"upstream": "127.0.0.1:8080", "port": 8081}, {"upstream": "ftp://h", "port": 1},
                {"upstream": "http://h:1", "port": 0}, {"upstream": "http://h:1", "port": 1, "read_timeout_s": 0}):
        with pytest.raises(pydantic.ValidationError):
            ProxyOptions(**bad)
    assert ProxyOptions(upstream="http://127.0.0.1:8080", port=8081).read_timeout_s == 600.0


def test_engine_proxy_cli_refuses_a_bad_upstream_in_one_line():
    out = subprocess.run([sys.executable, "-m", "sparecycles.cli", "engine-proxy", "--upstream", "localhost:1",
                          "--port", "1"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2 and "--upstream" in out.stderr
