"""When each of vLLM's load signals sees a request: `python -m benchmarks.serving_signal [--requests N] [--out F]`.

A real vLLM (tools/vllm.sh, SmolLM2-135M, float32, with --enable-server-load-tracking) pinned to CPU 0; this process
on CPU 1 sends one streamed completion at a time (a ~130-token prompt, 16 tokens out) and polls both signals every
10 ms until it ends: the /metrics gauges vllm:num_requests_running + vllm:num_requests_waiting and /load's
server_load. Per request: seconds from sending to the first poll that saw each signal above 0, to the first token, and
to the end. Why it matters: a yielding worker (probe_worker.serving) computes until its signal rises.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks import RESULTS

PROMPT = "In the beginning God created the heaven and the earth. " * 10


def _gauges(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/metrics").text
    names = ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))


def _one(client: httpx.Client, url: str, model: str) -> dict[str, float]:
    """One request's timings (seconds after sending): metrics, load, first token, end."""
    seen: dict[str, float] = {}

    def stream() -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:") and "first" not in seen:
                    seen["first"] = time.time()
        seen["end"] = time.time()

    t0 = time.time()
    th = threading.Thread(target=stream)
    th.start()
    while th.is_alive():
        if "metrics" not in seen and _gauges(client, url) > 0:
            seen["metrics"] = time.time()
        if "load" not in seen and client.get(url + "/load").json()["server_load"] > 0:
            seen["load"] = time.time()
        time.sleep(0.01)
    th.join()
    return {k: round(v - t0, 4) for k, v in seen.items()}


def measure(requests: int) -> dict:
    """Start vLLM on CPU 0, time `requests` requests one after another, stop it; returns the result dict."""
    from api.server import free_port
    from probe_worker.engine import VllmProcess
    from trainer.models.pretrained import smollm2_dir

    os.sched_setaffinity(0, {1})
    engine = VllmProcess(smollm2_dir(), free_port(), Path(tempfile.mkdtemp()) / "vllm.log", cpus=[0],
                         extra_args=["--enable-server-load-tracking"])
    with engine, httpx.Client(timeout=10) as client:
        model = client.get(engine.url + "/v1/models").json()["data"][0]["id"]
        _one(client, engine.url, model)  # warm-up, not counted
        rows = []
        for _ in range(requests):
            rows.append(_one(client, engine.url, model))
            time.sleep(1.0)
    return {"requests": rows, "load_avg_1min": os.getloadavg()[0], "poll_s": 0.01, "engine_cpu": 0,
            "span_s": {k: [min(r[k] for r in rows if k in r), max(r[k] for r in rows if k in r)]
                       for k in ("load", "metrics", "first", "end")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path(RESULTS) / "cpu/serving/signal.json")
    a = p.parse_args()
    res = measure(a.requests)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["span_s"]))


if __name__ == "__main__":
    main()
