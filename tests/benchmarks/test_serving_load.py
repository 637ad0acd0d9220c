"""`bench serving`'s arithmetic (benchmarks.serving_load, benchmarks.serving_figures.arm_figures): exact values on small cases."""

from __future__ import annotations

import pytest

from benchmarks.serving_figures import arm_figures, worker_trace
from benchmarks.serving_load import (
    CONTEXT,
    MAX_OUT,
    MIN_OUT,
    Outcome,
    make_requests,
    overlap,
    percentiles,
    run_load,
    union,
)


def test_union_overlap_and_percentiles():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap([(0, 2), (3, 4)], [(1, 3.5)]) == 1.5
    assert percentiles([5, 1, 4, 2, 3]) == {"p50": 3, "p95": 5, "p99": 5}
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p95": 95, "p99": 99}


def test_requests_are_seeded_passages_with_next_sentence_lengths():
    text = [f"w{i} " * (i % 50 + 4) for i in range(200)]
    reqs = make_requests(10, 0.5, 7, text)
    assert reqs == make_requests(10, 0.5, 7, text) and reqs != make_requests(10, 0.5, 8, text)
    assert all(a.at_s < b.at_s for a, b in zip(reqs, reqs[1:]))
    assert all(MIN_OUT <= r.max_tokens <= MAX_OUT for r in reqs)
    starts = [text.index(next(t for t in text if r.prompt.startswith(t.strip()))) for r in reqs]
    assert [b - a for a, b in zip(starts, starts[1:])] == [CONTEXT] * 9
    with pytest.raises(ValueError):
        make_requests(100, 0.5, 0, text)


def test_a_stopped_load_sends_nothing_more_and_returns_what_it_sent():
    import threading

    stop = threading.Event()
    stop.set()  # `up --serving`'s runs ended before the first arrival: no request goes out, none is reported
    text = [f"w{i} " * (i % 50 + 4) for i in range(200)]
    assert run_load("http://127.0.0.1:9", "m", make_requests(3, 0.5, 7, text), stop=stop) == []


def test_arm_figures_idle_share_and_reclaim():
    # two requests busy [10, 12] and [15, 16] in an arm [10, 20]: idle 7 s
    outs = [Outcome(sent=10.0, first=10.5, end=12.0, tokens=4), Outcome(sent=15.0, first=15.2, end=16.0, tokens=2)]
    # worker tasks: [9, 10.4] cut (clipped to 10), [12.5, 14] done, [14.5, 15.3] cut, [17, 20] done
    spans = [(10.0, 10.4, "preempted"), (12.5, 14.0, "done"), (14.5, 15.3, "preempted"), (17.0, 20.0, "done")]
    f = arm_figures([(outs, spans, 10.0, 20.0)])
    assert f["engine_idle_s"] == 7.0 and f["worker_task_s"] == pytest.approx(5.7)
    assert f["idle_used_s"] == pytest.approx(5.7 - 0.4 - 0.3) and f["idle_used_share"] == pytest.approx(5.0 / 7)
    assert f["reclaims"] == 1 and f["reclaim_s"]["p95"] == pytest.approx(0.3)  # 15.0 -> 15.3; 10.0 is no arrival inside
    assert f["ttft_s"]["p50"] == pytest.approx(0.2) and f["output_tokens_per_s"] == pytest.approx(0.6)
    assert f["tasks_cut"] == 2


def test_arm_figures_split_reclaim_into_detect_and_cut_from_the_gate_events():
    # a request at 15.0 arrives while a task [14.5, 15.3] runs; the gate's reading started at 15.05, took 0.05 s
    outs = [Outcome(sent=15.0, first=15.2, end=16.0, tokens=2)]
    spans = [(14.5, 15.3, "preempted")]
    events = [{"event": "yield", "t": 12.0, "scrape_s": 0.01}, {"event": "yield", "t": 15.05, "scrape_s": 0.05},
              {"event": "resume", "t": 16.6, "cpu_s": 0.0}]
    f = arm_figures([(outs, spans, 14.0, 17.0, events)])
    assert f["reclaims"] == 1 and f["reclaim_s"]["p95"] == pytest.approx(0.3)
    assert f["reclaim_detect_s"]["p95"] == pytest.approx(0.1) and f["reclaim_cut_s"]["p95"] == pytest.approx(0.2)


def test_a_cut_tasks_span_ends_when_its_evaluation_stopped_and_its_hand_back_is_counted_apart(tmp_path):
    from probe_worker.task_trace import TraceFile

    trace = TraceFile(tmp_path / "t.jsonl")
    trace(14.5, 16.0, "preempted", fired=15.05, where="f", stopped=15.3)  # stopped at 15.3, handed back by 16.0
    trace(16.5, 17.5, "done")
    spans, events = worker_trace(tmp_path / "t.jsonl", 14.0, 18.0)
    assert spans == [(14.5, 15.3, "preempted"), (16.5, 17.5, "done")]
    assert events == [{"event": "hand_back", "t": 16.0, "stopped": 15.3}]
    f = arm_figures([([Outcome(sent=15.0, first=15.2, end=16.0, tokens=2)], spans, 14.0, 18.0, events)])
    assert f["reclaim_s"]["p95"] == pytest.approx(0.3) and f["hand_back_s"]["p95"] == pytest.approx(0.7)


def test_the_freeze_watchers_stops_come_out_of_the_spans_and_end_the_reclaim(tmp_path):
    from benchmarks.serving_figures import frozen_intervals, minus_frozen, worker_trace
    from probe_worker.task_trace import TraceFile

    assert frozen_intervals([{"event": "thaw", "t": 1.0}, {"event": "freeze", "t": 2.0}, {"event": "thaw", "t": 3.0},
                             {"event": "freeze", "t": 5.0}], 9.0) == [(2.0, 3.0), (5.0, 9.0)]
    assert minus_frozen([(0.0, 4.0, "preempted"), (4.5, 6.0, "done")], [(1.0, 2.0), (5.0, 9.0)]) == [
        (0.0, 1.0, "done"), (2.0, 4.0, "preempted"), (4.5, 5.0, "done")]
    trace = TraceFile(tmp_path / "t.jsonl")
    # a task [14.5, 17.0]: a request at 15.0; the watcher stopped it at 15.12 and continued it at 16.0 (engine idle);
    # the gate, told of the stop, cut it at 16.1; its hand-back ended at 17.0
    trace.event("freeze", 15.12)
    trace.event("thaw", 16.0)
    trace.event("yield", 16.05, scrape_s=0.01, load=0.0, cut=True, frozen=15.12)
    trace(14.5, 17.0, "preempted", fired=16.06, where="f", stopped=16.1, frozen=15.12)
    spans, events = worker_trace(tmp_path / "t.jsonl", 14.0, 18.0)
    assert spans == [(14.5, 15.12, "done"), (16.0, 16.1, "preempted")]
    f = arm_figures([([Outcome(sent=15.0, first=15.2, end=16.0, tokens=2)], spans, 14.0, 18.0, events)])
    assert f["reclaims"] == 1 and f["reclaim_s"]["p95"] == pytest.approx(0.12)
    assert f["reclaim_detect_s"]["p95"] == pytest.approx(0.12) and f["reclaim_cut_s"]["p95"] == 0.0
    assert f["worker_task_s"] == pytest.approx(0.62 + 0.1) and f["hand_back_s"]["p95"] == pytest.approx(0.9)


def test_block_order_rotates_so_no_arm_always_follows_the_same_one():
    from benchmarks.serving import block_order

    assert [block_order(("a", "b", "c"), k) for k in range(4)] == [("a", "b", "c"), ("b", "c", "a"),
                                                                   ("c", "a", "b"), ("a", "b", "c")]


def test_paired_ratios_over_the_same_requests_with_a_block_bootstrap():
    from benchmarks.serving_figures import paired_ratios

    def blocks(scale: float) -> list[dict]:  # two blocks of 10 requests, latencies 1..20 s times `scale`
        return [{"requests": [{"ttft_s": scale * (10 * b + i + 1), "e2e_s": 2 * scale * (10 * b + i + 1)}
                              for i in range(10)]} for b in range(2)]

    raw = {"a": blocks(1.0), "c": blocks(1.1)}
    raw["c"][0]["requests"][0]["e2e_s"] = None  # an error: that request leaves both arms' e2e figures
    got = paired_ratios(raw, seed=0, resamples=200)["c"]
    assert got["ttft_s"]["p95_ratio"] == pytest.approx(1.1) and got["ttft_s"]["median_request_ratio"] == pytest.approx(1.1)
    lo, hi = got["ttft_s"]["p95_ratio_90ci"]
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)  # every resample scales alike: no spread
    assert got["e2e_s"]["p95_ratio"] == pytest.approx(1.1) and got["e2e_s"]["requests"] == 19  # paired: 0 left out of both
    assert paired_ratios(raw, seed=0, resamples=200) == paired_ratios(raw, seed=0, resamples=200)  # seeded


class _Streams:
    """A real HTTP/1.1 server on loopback (keep-alive unless the client closes) answering /v1/completions with a
    two-token stream after `delay_s`; it records each request's client port and the most requests it held at once."""

    def __init__(self, delay_s: float = 0.0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.ports: list[int] = []
        self.prompts: list[str] = []
        self.held = self.most_held = 0
        lock, rec = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                import json
                import time

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    rec.ports.append(self.client_address[1])
                    rec.prompts.append(body["prompt"])
                    rec.held += 1
                    rec.most_held = max(rec.most_held, rec.held)
                time.sleep(delay_s)
                with lock:
                    rec.held -= 1
                out = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_each_request_goes_out_on_a_connection_of_its_own():
    """run_load keeps no connection alive between requests: a reused idle connection races the server's keep-alive
    timeout (vLLM's uvicorn and httpx both keep one 5 s), and a request sent ~5 s after the last answer then failed
    with "Server disconnected without sending a response" (seen in `bench serving`)."""
    server = _Streams()
    try:
        text = [f"w{i} " * (i % 50 + 4) for i in range(200)]
        outs = run_load(server.url, "m", make_requests(4, 20.0, 3, text))
    finally:
        server.close()
    assert [(o.error, o.tokens) for o in outs] == [("", 2)] * 4
    assert len(server.ports) == 4 and len(set(server.ports)) == 4  # four requests, four connections


def test_a_blocks_warm_up_sends_its_requests_once_one_after_another():
    """`bench serving`'s warm-up (benchmarks.serving._warm_prompts): every request of the block once, in order, never two at
    once (the engine sees each prompt alone, as the arms' requests will be), whatever their arrival times."""
    from benchmarks.serving import _warm_prompts

    server = _Streams(delay_s=0.05)
    said: list[str] = []
    try:
        text = [f"w{i} " * (i % 50 + 4) for i in range(200)]
        reqs = make_requests(3, 50.0, 5, text)  # arrivals ~20 ms apart: open loop, they would overlap
        _warm_prompts(server.url, "m", reqs, said.append)
    finally:
        server.close()
    assert server.prompts == [r.prompt for r in reqs] and server.most_held == 1 and said == []
