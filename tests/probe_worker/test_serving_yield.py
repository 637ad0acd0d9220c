"""Engine-aware yielding end to end: a real vLLM (tools/vllm.sh), a real coordinator and a real worker process started
with `--serving-metrics` on the engine's /load (a request counted on arrival). A burst of requests stops the worker's
running task within one control interval plus one task (its freeze watcher, probe_worker.freeze) and cuts it, the worker takes nothing while the burst runs, resumes only
after the hold, and the round it was holding is re-issued, evaluated once, with the in-process values."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.fleet import Fleet, make_batch
from support.models import tiny_gpt2
from trainer.train import lm_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import RoundSpec

pytestmark = pytest.mark.slow  # a vLLM process, a coordinator process and a worker process

INTERVAL_S, HOLD_S, SEEDS = 0.25, 1.0, 16


def _spans(path, key="outcome"):
    """The trace's task lines (key "outcome") or gate events (key "event")."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [d for d in lines if key in d]


def _burst(engine_url: str, load_url: str, n: int) -> tuple[list[float], float]:
    """n concurrent completions (32 tokens each), while this thread reads the engine's /load every 50 ms. Returns when
    each answer arrived (unix s) and the last time a reading that saw the engine busy was sent (unix s, taken before
    the request: the engine was busy at or after it, so a worker's hold ends no earlier than it plus the hold)."""
    model = httpx.get(engine_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    done: list[float] = []

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}
        httpx.post(engine_url + "/v1/completions", json=body, timeout=300).raise_for_status()
        done.append(time.time())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    busy_at = 0.0
    while any(t.is_alive() for t in threads):
        sent = time.time()
        if httpx.get(load_url, timeout=30).json()["server_load"] >= 1:
            busy_at = sent
        time.sleep(0.05)
    for t in threads:
        t.join()
    return done, busy_at


def _results(be, round_id: str) -> dict:
    out = {}
    for r in be.collect(round_id).results:
        assert r.seed not in out, f"seed {r.seed} delivered twice"
        out[r.seed] = r
    return out


def test_a_burst_cuts_the_task_drains_the_worker_and_its_round_is_reissued_once(vllm_engine, tmp_path):
    fleet = Fleet(tmp_path)
    trace = tmp_path / "spans.jsonl"
    try:
        fleet.start_worker("w", "--serving-metrics", vllm_engine.load_url, "--serving-hold", str(HOLD_S),
                           "--task-trace", str(trace), "--control-interval", str(INTERVAL_S))
        fleet.wait_consuming("w")
        pid = fleet.workers["w"].pid  # beside an engine its tasks run at nice 19 (the main thread runs them)
        fleet.wait(lambda: os.getpriority(os.PRIO_PROCESS, pid) == 19, "the worker's tasks at nice 19")
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert any(b"probe_worker.freeze" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children)  # its watcher
        # a model slow enough on one thread that one task of SEEDS seeds takes seconds
        model = tiny_gpt2(vocab_size=128, n_positions=64, n_embd=192, n_layer=4, n_head=4, seed=5)
        be = fleet.backend(model, "serve", seeds_per_task=SEEDS)
        be.publish(0)
        batch = make_batch(8, 64, seed=5)
        rounds = [RoundSpec(f"s-{k}", 0, batch, eps=1e-2, seeds=tuple(range(100 * k, 100 * k + SEEDS)),
                            distribution="gauss8") for k in range(2)]
        be.submit(rounds[0])  # uncut: how long one task takes here (the bound's "one task")
        first = _results(be, "s-0")
        # the worker writes a task's trace line after posting its results: the trainer can have them first
        fleet.wait(lambda: any(s["outcome"] == "done" for s in _spans(trace)), "round s-0's trace line")
        one_task_s = max(s["end"] - s["start"] for s in _spans(trace) if s["outcome"] == "done")

        t_first = time.time()
        be.submit(rounds[1])

        def evaluating() -> bool:  # a heartbeat sent after round s-0 ended says busy: it is round s-1's
            info = fleet.worker_info("w")
            return info["busy"] and info["last_heartbeat"] > t_first

        fleet.wait(evaluating, "the worker evaluating round s-1")
        t_req = time.time()
        answered, busy_at = _burst(vllm_engine.url, vllm_engine.load_url, 3)
        t_last = max(answered)
        second = _results(be, "s-1")  # waits for the re-issued task, after the hold
        fleet.wait(lambda: sum(s["outcome"] == "done" for s in _spans(trace)) >= 2, "the re-issued task's trace line")
        print(f"one task {one_task_s:.2f} s; burst {t_last - t_req:.2f} s")
        print("cut:", _spans(trace)[-3:])

        spans = [s for s in _spans(trace) if s["outcome"] in ("done", "preempted")]
        cut = [s for s in spans if s["outcome"] == "preempted"]
        assert len(cut) == 1 and cut[0]["start"] < t_req <= cut[0]["end"]
        # reclaimed within one interval plus one task: the freeze watcher's stop (probe_worker.freeze) ends it, the
        # cut follows once the engine reads idle (the stopped worker's own readings may not have seen the burst)
        reclaimed = min(cut[0].get("frozen", cut[0]["end"]), cut[0]["end"])
        assert t_req <= reclaimed and reclaimed - t_req <= INTERVAL_S + one_task_s
        events = _spans(trace, "event")
        if "frozen" in cut[0]:  # the watcher read the burst first (else the worker's own reading did, and cut it)
            freezes = [e["t"] for e in events if e["event"] == "freeze" and e["t"] >= t_req]
            thaws = [e["t"] for e in events if e["event"] == "thaw" and e["t"] >= t_req]
            assert freezes[0] == pytest.approx(cut[0]["frozen"], abs=1e-5) and freezes[0] < thaws[0]
        yielded = [e for e in events if e["event"] == "yield" and e["t"] + e["scrape_s"] >= t_req]
        # the gate fired the task: it saw the burst in /load, or was told of the watcher's stop
        assert yielded[0]["cut"] and (yielded[0]["load"] >= 1 or yielded[0]["frozen"] == cut[0]["frozen"])
        assert t_req <= cut[0]["fired"] <= cut[0]["end"] and cut[0]["where"]
        # nothing evaluated during the burst, nor in the hold after the engine's last busy reading (this test's own,
        # not the client's last byte: on a loaded machine that comes long after the engine read idle)
        assert 0 < busy_at and not [s for s in spans if t_req <= s["start"] < busy_at + HOLD_S]
        # the gate resumed after HOLD_S of idle readings, the first after its last busy one
        resumed = min(s["start"] for s in spans if s["start"] > t_req)
        resume = max((e for e in events if e["event"] == "resume" and e["t"] <= resumed), key=lambda e: e["t"])
        assert resume["t"] - resume["idle_since"] >= HOLD_S - 1e-5 and resume["t"] > t_req
        assert resume["idle_since"] > max(e["t"] for e in events if e["event"] == "yield" and e["t"] < resume["t"])

        ref = InProcessBackend(model, lambda m, b: lm_loss(m, b[0], b[1]))
        for spec, got in zip(rounds, (first, second)):
            ref.submit(spec)
            want = {r.seed: (r.l_plus, r.l_minus) for r in ref.collect(spec.round_id).results}
            assert {s: (r.l_plus, r.l_minus) for s, r in got.items()} == want
        assert be.collect().results == []  # nothing delivered twice
        intake = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(
            httpx.get(fleet.url + "/metrics", timeout=30).text) for s in f.samples
            if s.name == "sparecycles_intake_results_total"}
        assert intake["accepted"] == 2 * SEEDS and intake.get("duplicate", 0.0) == 0.0  # each seed counted once
        assert fleet.metric("w", "sparecycles_worker_serving_yielded_seconds_total") > 0
        serving = fleet.worker_info("w")["serving"]
        assert serving["reclaims"] >= 1 and serving["reclaim_p95_s"] <= INTERVAL_S + one_task_s
        assert serving["scrape_errors"] == 0 and serving["idle_used_s"] > 0
        be.close()
    finally:
        fleet.close()
