"""`up --serving vllm`'s account of its request load (sparecycles.up_serving): the requests not yet due when the runs
end are never sent, and serving.json and the summary line say how many of those planned were sent and why, rather
than "3/3 requests answered" for a load of 40. No engine here: the load's outcomes are set as run_load returns them.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from benchmarks.serving_load import CONTEXT, Outcome, make_requests
from sparecycles.up_options import SERVING_JSON, UpOptions
from sparecycles.up_serving import LOAD_SEED, ServingRun, _finish, alone_count, serving_beside, split_requests


def _run(tmp_path, logs: list[str]) -> ServingRun:
    demo = UpOptions(serving="vllm").serving_demo  # the defaults: 40 requests at 0.1/s
    text = [f"sentence {i} of a passage long enough." for i in range(demo.requests * CONTEXT + 1)]
    engine = SimpleNamespace(model_dir=tmp_path / "smollm2", url="http://127.0.0.1:1", log_path=tmp_path / "vllm.log",
                             load_url="http://127.0.0.1:1/load", stop=lambda: None)
    requests = make_requests(demo.requests, demo.rate, LOAD_SEED, text)
    return ServingRun(demo, engine, "smollm2", requests, logs.append)


def _answered(n: int) -> list[Outcome]:
    t = time.time()
    return [Outcome(sent=t + i, first=t + i + 0.2, end=t + i + 1.0, tokens=8) for i in range(n)]


def test_a_load_the_runs_ended_before_says_how_many_of_its_requests_were_sent(tmp_path):
    logs: list[str] = []
    run = _run(tmp_path, logs)
    span = run.requests[-1].at_s
    assert span > 300  # 40 Poisson arrivals at 0.1/s span minutes; `up --steps 12` trains for well under one
    t0 = time.time()
    run.started_at = t0 - 28.0  # the load began with the fleet-probed run, 28 s before its end (which _finish stamps)
    run.outcomes = _answered(3)  # run_load returns the outcomes of the requests sent before the stop
    figures = _finish(run, tmp_path, 0.0, logs.append)
    t1 = time.time()
    assert (figures["requests_planned"], figures["requests_sent"], figures["requests_unsent"]) == (40, 3, 37)
    assert figures["answered"] == 3 and figures["failed"] == 0 and figures["load_planned_s"] == span
    # its end was stamped between this test's two readings (a loaded machine widens the bracket, never breaks it)
    ran = figures["load_ran_s"]
    assert 28.0 <= ran <= 28.0 + (t1 - t0) and figures["load_ended_by"] == "the runs ended"
    assert json.loads((tmp_path / SERVING_JSON).read_text())["requests_unsent"] == 37
    [line] = logs
    assert line.startswith(f"serving: 3 of 40 requests sent: the runs ended {ran:.0f} s into the load, whose arrivals at "
                           f"0.1/s span ~{span:.0f} s (fewer --serving-requests or a higher --serving-rate fit a "
                           "shorter run); 3/3 requests answered (0 failed); TTFT p50/p95 0.20/0.20 s")


def test_a_load_sent_in_full_or_never_started_is_reported_as_such(tmp_path):
    logs: list[str] = []
    run = _run(tmp_path, logs)
    run.started_at, run.outcomes = time.time() - 400.0, _answered(40)
    figures = _finish(run, tmp_path, 0.0, logs.append)
    assert figures["requests_unsent"] == 0 and logs[-1].startswith("serving: 40/40 requests answered (0 failed); TTFT")

    never = _run(tmp_path, logs)  # the fleet-probed run was reused: only AdamW trained, the load never began
    figures = _finish(never, tmp_path, 0.0, logs.append)
    assert (figures["requests_sent"], figures["requests_unsent"], figures["load_ran_s"]) == (0, 40, None)
    assert logs[-1].startswith("serving: 0 of 40 requests sent: the load never started (the fleet-probed run, with "
                               "which it starts, did not train this time); TTFT")


def test_a_load_cut_or_never_started_by_an_error_says_so(tmp_path, monkeypatch):
    logs: list[str] = []
    run = _run(tmp_path, logs)
    monkeypatch.setattr("sparecycles.up_serving._start", lambda demo, out, log: run)
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt), serving_beside(run.demo, tmp_path, logs.append) as started:
        started.started_at, started.outcomes = t0 - 5.0, _answered(1)
        raise KeyboardInterrupt
    ran = started.stopped_at - started.started_at  # its end, stamped on the way out: within this test's bracket
    assert 5.0 <= ran <= 5.0 + (time.time() - t0)
    assert logs[-1].startswith(f"serving: 1 of 40 requests sent: up stopped early (an error or Ctrl-C) {ran:.0f} s "
                               "into the load")

    never = _run(tmp_path, logs)
    monkeypatch.setattr("sparecycles.up_serving._start", lambda demo, out, log: never)
    with pytest.raises(RuntimeError), serving_beside(never.demo, tmp_path, logs.append):
        raise RuntimeError("the AdamW baseline failed")
    assert logs[-1].startswith("serving: 0 of 40 requests sent: the load never started (up stopped early (an error "
                               "or Ctrl-C) before the fleet-probed run it starts with)")


def test_the_load_is_set_against_the_engine_alone_and_the_idle_seconds_used(tmp_path):
    warmup, alone, load = split_requests(40, alone_count(40), 0.1, LOAD_SEED)
    assert (len(alone), len(load)) == (14, 40) and alone_count(8) == 6  # a third of the load, at least 6
    prompts = [r.prompt for r in (warmup, *alone, *load)]
    assert len(set(prompts)) == len(prompts)  # no prompt repeats: the prefix cache helps neither block
    assert warmup.at_s == 0.0 and 0 < alone[0].at_s < alone[-1].at_s and 0 < load[0].at_s < load[-1].at_s
    logs: list[str] = []
    run = _run(tmp_path, logs)
    t = time.time()
    run.started_at = t - 400.0
    run.outcomes = [Outcome(sent=t, first=t + 0.1 * (i + 1), end=t + 1.5 * (i + 1), tokens=8) for i in range(40)]
    run.alone = [Outcome(sent=t, first=t + 0.1, end=t + 1.0 * (i + 1), tokens=8) for i in range(14)]
    run.workers = [{"name": "local-0", "yielded_s": 5.0, "engine_idle_s": 200.0, "idle_used_s": 50.0},
                   {"name": "local-1", "yielded_s": 3.0, "engine_idle_s": 200.0, "idle_used_s": 70.0}]
    figures = _finish(run, tmp_path, 0.0, logs.append)
    assert figures["alone"]["answered"] == figures["alone"]["requests_sent"] == 14
    # nearest-rank p95: the load's 38th of 40 (57.0 s end to end, 3.8 s TTFT) over the block's 14th of 14 (14.0, 0.1)
    assert (figures["e2e_s"]["p95"], figures["alone"]["e2e_s"]["p95"]) == pytest.approx((57.0, 14.0))
    ratio = figures["p95_vs_alone"]
    assert ratio["e2e_s"] == pytest.approx(figures["e2e_s"]["p95"] / figures["alone"]["e2e_s"]["p95"])
    assert ratio["ttft_s"] == pytest.approx(figures["ttft_s"]["p95"] / figures["alone"]["ttft_s"]["p95"])
    assert figures["workers_total"]["idle_used_share"] == pytest.approx(120.0 / 400.0)
    assert len(figures["requests_alone"]) == 14
    assert logs[-1].startswith(f"serving: 40/40 requests answered (0 failed); TTFT p50/p95 2.00/3.80 s, end to end "
                               f"30.00/57.00 s; p95 {57 / 14:.2f}x end to end, {3.8 / 0.1:.2f}x TTFT, of the engine "
                               "alone (14.00/0.10 s, 14 requests); workers yielded 8.0 s, used 120.0 of the engine's "
                               "400.0 idle s (30%)")
