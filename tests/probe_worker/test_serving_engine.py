"""The real vLLM beside the fleet (tools/vllm.sh, probe_worker.engine): it serves SmolLM2-135M over the
OpenAI-compatible API and exposes the queue gauges that engine-aware yielding reads."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_vllm_serves_smollm2_and_exposes_its_queue_gauges(vllm_engine):
    with httpx.Client(base_url=vllm_engine.url, timeout=120.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        first = client.post("/v1/completions", json=body).json()
        again = client.post("/v1/completions", json=body).json()
        metrics = client.get("/metrics").text
        # vLLM counts a request off /load in a background task run after its response was sent, which this test may
        # read first: wait for it (a liveness bound only)
        deadline = time.monotonic() + 60
        while (load := client.get("/load").json()) != {"server_load": 0} and time.monotonic() < deadline:
            time.sleep(0.05)
    assert first["usage"]["completion_tokens"] == 4
    assert first["choices"][0]["text"] == again["choices"][0]["text"]  # greedy: the same tokens twice
    assert first["choices"][0]["text"].strip().startswith("Paris")
    idle = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))}
    assert idle == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    assert load == {"server_load": 0}  # /load (--enable-server-load-tracking): what a yielding worker reads
