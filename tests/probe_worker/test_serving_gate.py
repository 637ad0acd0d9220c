"""Engine-aware yielding's pure parts (probe_worker.serving): the gate's hysteresis, the ledger's figures, the
engines' gauges read from Prometheus text, a bad endpoint counted and yielded to, and a task cut at a module call."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from pydantic import ValidationError

from probe_worker.metrics import WorkerMetrics
from probe_worker.preemption import Preempted, Preemption
from probe_worker.serving import (
    EngineGate,
    EngineProbe,
    ServingLedger,
    ServingPolicy,
    ServingWatch,
    Unreadable,
    engine_load,
    server_load,
)
from probe_worker.task_trace import TraceFile
from probe_worker.tasks import DrainState

POLICY = ServingPolicy(metrics_url="http://127.0.0.1:9/metrics")


def test_gate_yields_at_once_and_resumes_only_after_the_hold():
    gate = EngineGate(busy_above=0.0, hold_s=2.0)
    # (time s, load) -> yield?  Starts yielding; idle from t=0; resumes at t=2.0 exactly, not at 1.5.
    steps = [(0.0, 0.0, True), (1.5, 0.0, True), (2.0, 0.0, False), (2.5, 1.0, True), (3.0, 0.0, True),
             (4.5, 0.0, True), (4.9, 0.0, True), (5.0, 0.0, False), (5.5, None, True), (6.0, 0.0, True),
             (8.0, 0.0, False)]
    assert [gate.update(t, load) for t, load, _ in steps] == [want for *_, want in steps]


def test_gate_threshold_counts_requests_above_it_only():
    gate = EngineGate(busy_above=2.0, hold_s=0.0)
    assert [gate.update(t, load) for t, load in [(0, 2.0), (1, 3.0), (2, 2.0), (3, None)]] == [False, True, False,
                                                                                               True]


def test_ledger_integrates_yield_idle_used_and_reclaim():
    led = ServingLedger()
    # t=0 idle, worker yielding (hold), 0 busy s so far
    assert led.update(0.0, idle=True, yielding=True, busy_s=0.0, task_running=False, last_task_end=None) is None
    # t=1 idle, resumed; no task yet
    led.update(1.0, idle=True, yielding=False, busy_s=0.0, task_running=False, last_task_end=None)
    # t=2 idle; 0.75 s of tasks in (1, 2]
    led.update(2.0, idle=True, yielding=False, busy_s=0.75, task_running=True, last_task_end=1.5)
    # t=3 busy (a request arrived in (2, 3]); a task is running: reclaim pending from t0=2
    assert led.update(3.0, idle=False, yielding=True, busy_s=1.6, task_running=True, last_task_end=1.5) is None
    # t=3.5: that task ended at 3.1 -> latency 3.1 - 2.0
    assert led.update(3.5, idle=False, yielding=True, busy_s=1.7, task_running=False,
                      last_task_end=3.1) == pytest.approx(1.1)
    assert (led.yielded_s, led.engine_idle_s, led.idle_used_s) == pytest.approx((1.0 + 0.5, 2.0, 0.75))
    # busy -> idle -> busy with no task running: a reclaim of 0
    led.update(4.0, idle=True, yielding=True, busy_s=1.7, task_running=False, last_task_end=3.1)
    assert led.update(5.0, idle=False, yielding=True, busy_s=1.7, task_running=False, last_task_end=3.1) == 0.0
    assert led.reclaim_count == 2 and led.reclaim_p95() == pytest.approx(1.1)


VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


@pytest.mark.parametrize("text, want", [
    (VLLM_TEXT, 7.0),
    ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n", 3.0),
    ("# TYPE tgi_queue_size gauge\ntgi_queue_size 5\n# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 2\n",
     7.0),
    ("llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n", 1.0),
])
def test_engine_load_sums_each_engines_queue_gauges(text, want):
    assert engine_load(text, POLICY) == want


def test_engine_load_named_gauges_and_refusals():
    named = POLICY.model_copy(update={"gauges": ("vllm:kv_cache_usage_perc",)})
    assert engine_load(VLLM_TEXT, named) == 0.5
    for text, reason in [("up 1\n", "no_gauge"), ("vllm:num_requests_running NaN\n", "non_finite"),
                         ("vllm:num_requests_running -1\n", "non_finite"), ("vllm:num_requests_running{ 1\n", "parse")]:
        with pytest.raises(Unreadable) as err:
            engine_load(text, POLICY)
        assert err.value.reason == reason


def test_server_load_reads_vllms_load_endpoint_and_refuses_the_rest():
    assert server_load('{"server_load": 3}') == 3.0 and server_load('{"server_load": 0}') == 0.0
    for text, reason in [("<html>", "parse"), ("[1]", "no_gauge"), ('{"load": 1}', "no_gauge"),
                         ('{"server_load": -1}', "non_finite"), ('{"server_load": "2"}', "non_finite"),
                         ('{"server_load": true}', "non_finite")]:
        with pytest.raises(Unreadable) as err:
            server_load(text)
        assert err.value.reason == reason


def test_policy_bounds_are_checked():
    with pytest.raises(ValidationError):
        ServingPolicy(metrics_url="http://127.0.0.1:9/metrics", hold_s=-1)
    with pytest.raises(ValidationError):
        ServingPolicy(metrics_url="not a url")
    with pytest.raises(ValidationError):
        ServingPolicy(metrics_url="http://127.0.0.1:9/metrics", engine="triton")


def test_an_unreachable_endpoint_is_counted_and_yielded_to():
    from prometheus_client import CollectorRegistry

    metrics = WorkerMetrics(CollectorRegistry())
    drain = DrainState()
    # port 9 (discard) on loopback: nothing listens, the connection is refused
    watch = ServingWatch(POLICY.model_copy(update={"hold_s": 0.0}), drain, metrics, EngineProbe(POLICY))
    assert watch.tick(0.0) is True and not drain.taking_tasks
    assert watch.tick(1.0) is True
    assert watch.scrape_errors == 2
    assert metrics.serving_errors.labels("unreachable")._value.get() == 2
    assert watch.figures().scrape_errors == 2 and watch.figures().engine_idle_s == 0.0


class _Loads:
    def __init__(self, loads):
        self.loads = iter(loads)

    def read(self):
        value = next(self.loads)
        if value is None:
            raise Unreadable("http", "HTTP 500")
        return value

    def close(self):
        pass


def test_watch_drains_resumes_and_fires_the_running_task(tmp_path):
    import json

    from prometheus_client import CollectorRegistry

    metrics = WorkerMetrics(CollectorRegistry())
    drain = DrainState()
    trace = TraceFile(tmp_path / "trace.jsonl")
    watch = ServingWatch(POLICY.model_copy(update={"hold_s": 1.0}), drain, metrics, _Loads([0, 0, 0, 2, None, 0]),
                         trace=trace)
    assert [watch.tick(t) for t in (0.0, 0.5, 1.0)] == [True, True, False] and drain.taking_tasks
    drain.preemption.arm()  # a task starts
    assert watch.tick(1.5) is True and drain.engine_busy  # a request: yield, and the task is fired
    with pytest.raises(Preempted):
        drain.preemption.check()
    drain.preemption.disarm()
    assert watch.tick(2.0) is True and metrics.serving_errors.labels("http")._value.get() == 1
    assert watch.tick(2.5) is True  # idle again, the hold restarts
    assert watch.ledger.reclaim_count == 1 and watch.ledger.yielded_s == pytest.approx(1.0 + 1.0)
    events = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert [(e["event"], e.get("load"), e.get("cut")) for e in events] == [("yield", 0, False), ("resume", None, None),
                                                                         ("yield", 2, True)]
    assert events[1]["t"] - events[1]["idle_since"] == pytest.approx(1.0, abs=2e-6)  # the hold, from its first idle reading
    assert drain.preemption.fired_at is not None and "test_serving_gate" not in drain.preemption.where  # no project frame


class _Link:
    """The worker's end of a freeze watcher (probe_worker.freeze.FreezeLink), as the watcher leaves it."""

    def __init__(self) -> None:
        self.stop: float | None = None

    def task_started(self) -> None:
        self.stop = None

    def task_ended(self) -> None:
        pass

    def stopped_at(self) -> float | None:
        return self.stop


def test_a_watcher_stop_the_readings_never_saw_holds_the_gate_cuts_the_task_and_is_the_reclaim(tmp_path):
    import json
    import time

    from prometheus_client import CollectorRegistry

    drain, link = DrainState(), _Link()
    drain.preemption.freeze = link
    trace = TraceFile(tmp_path / "trace.jsonl")
    watch = ServingWatch(POLICY.model_copy(update={"hold_s": 1.0}), drain, WorkerMetrics(CollectorRegistry()),
                         _Loads([0, 0, 0, 0, 0, 0, 0]), trace=trace)
    assert [watch.tick(t) for t in (0.0, 0.5, 1.0)] == [True, True, False]
    drain.preemption.arm()
    link.stop = time.time() - 0.1  # stopped 0.1 s before the next reading, continued when the engine read idle
    assert watch.tick(1.5) is True  # this reading sees idle, yet the gate holds, as if it had seen the request
    with pytest.raises(Preempted):
        drain.preemption.check()  # and the task is cut: its round is re-issued as before
    assert watch.ledger.reclaim_count == 1 and watch.ledger.reclaims[-1] == pytest.approx(0.4, abs=0.05)
    drain.preemption.disarm()
    assert [watch.tick(t) for t in (2.0, 2.5)] == [True, False]  # resumes one hold after that reading
    assert watch.ledger.reclaim_count == 1  # the same stop is counted once
    yields = [json.loads(line) for line in trace.path.read_text().splitlines() if '"yield"' in line]
    assert yields[-1]["cut"] and yields[-1]["load"] == 0 and yields[-1]["frozen"] == pytest.approx(link.stop)


def test_preemption_cuts_a_forward_at_a_module_call_in_the_task_thread_only():
    guard = Preemption()
    handle = guard.install()
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    calls = []
    model[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    guard.arm()
    guard.fire()
    other = []
    t = threading.Thread(target=lambda: other.append(model(torch.ones(1, 4)).shape))
    t.start()
    t.join()
    assert other == [torch.Size([1, 4])]  # another thread's forward is not cut
    assert guard.stopped_at is None  # fired, not yet taken effect
    calls.clear()
    before = time.time()
    with pytest.raises(Preempted):
        model(torch.ones(1, 4))
    assert calls == [] and before <= guard.stopped_at <= time.time()  # cut before the first module ran, then
    model(torch.ones(1, 4))  # fired once: the next forward runs
    guard.disarm()
    handle.remove()
    assert guard.last_end is not None and guard.busy_s(guard.last_end) >= 0.0


def test_watch_reads_slowly_only_while_yielding_to_a_busy_engine_or_drained_with_no_task_running():
    from prometheus_client import CollectorRegistry

    drain = DrainState()
    watch = ServingWatch(POLICY.model_copy(update={"hold_s": 1.0}), drain, WorkerMetrics(CollectorRegistry()),
                         _Loads([2, 2, 0, None, 3]))
    watch.tick(0.0)  # busy: yielding, no task
    assert watch.next_wait(0.05, 0.2) == 0.2
    drain.preemption.arm()  # a task still running (being cut): a fast reading sees it end and the next request
    assert watch.next_wait(0.05, 0.2) == 0.05
    drain.preemption.disarm()
    watch.tick(0.2)
    assert watch.next_wait(0.05, 0.2) == 0.2
    watch.tick(0.4)  # idle seen: the hold is counted at the fast rate
    assert drain.engine_busy and watch.next_wait(0.05, 0.2) == 0.05
    watch.tick(0.6)  # unreadable: yielding, but not known busy
    assert watch.next_wait(0.05, 0.2) == 0.05
    watch.tick(0.8)
    assert watch.next_wait(0.05, 0.2) == 0.2
    drain.set_engine_busy(False)
    drain.operator_drain = True  # drained by SIGUSR1: it takes no task whatever it reads
    assert watch.next_wait(0.05, 0.2) == 0.2


class _Runtime:
    """A ProbeRuntime stand-in whose run_task raises `exc` (the round is never withdrawn nor handed to a peer)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def withdrawn(self, task) -> bool:
        return False

    def run_task(self, task):
        raise self.exc


@pytest.mark.parametrize(("why", "level", "line"), [
    ("cut", "INFO", "cut (engine_busy): the serving engine needs the device"),
    ("held", "INFO", "not taking tasks (engine_busy: the serving engine stayed busy for 0.05 s)"),
    ("drained", "INFO", "not taking tasks (operator_drain)"),
    ("unreachable", "WARNING", "the coordinator is unreachable (connection refused)"),
])
def test_a_hand_back_logs_one_line_naming_task_round_and_why_not_a_traceback(caplog, monkeypatch, why, level, line):
    """A probe task cut for the serving engine, held while it stays busy, drained or left by an unreachable
    coordinator goes back to its queue (a Reject with requeue) and logs one line: no Celery Reject traceback. A real
    error keeps its traceback (below). The task runs in this process (Celery's eager apply, the tracer a worker runs)."""
    import logging

    import httpx
    from celery import Celery
    from prometheus_client import CollectorRegistry

    from probe_worker import tasks
    from wire.round_messages import ProbeTask

    monkeypatch.setattr(tasks, "SERVING_HOLD_CAP_S", 0.05)
    drain = DrainState()
    drain.set_operator_drain(why == "drained")
    drain.set_engine_busy(why == "held")
    exc = httpx.ConnectError("connection refused") if why == "unreachable" else Preempted("the engine")
    app = Celery("hand-back-test", broker="memory://", set_as_current=False)
    probe = tasks.register_probe_task(app, _Runtime(exc), drain, WorkerMetrics(CollectorRegistry()))
    kwargs = ProbeTask(run="r", round_id="r-3", version=0, batch_sha256="0" * 64, eps=1e-3, distribution="gauss8",
                       seeds=[5, 6], want_clean=False).model_dump(mode="json")
    with caplog.at_level(logging.INFO):
        res = probe.apply(kwargs=kwargs, task_id=f"t-{why}")
    assert res.state == "REJECTED"
    assert drain.last_outcome == ("preempted" if why == "cut" else "requeued")
    got = [(r.name, r.levelname, r.getMessage(), r.exc_info) for r in caplog.records if r.levelno >= logging.INFO]
    assert got == [("sparecycles.worker", level, f"probe task t-{why} handed back to its queue: round r-3 seeds "
                    f"[5, 6]: {line}", None)]


def test_a_real_error_keeps_its_traceback(caplog):
    import logging

    from celery import Celery
    from prometheus_client import CollectorRegistry

    from probe_worker import tasks
    from wire.round_messages import ProbeTask

    app = Celery("error-test", broker="memory://", set_as_current=False)
    probe = tasks.register_probe_task(app, _Runtime(RuntimeError("boom")), DrainState(),
                                      WorkerMetrics(CollectorRegistry()))
    kwargs = ProbeTask(run="r", round_id="r-4", version=0, batch_sha256="0" * 64, eps=1e-3, distribution="gauss8",
                       seeds=[7], want_clean=False).model_dump(mode="json")
    with caplog.at_level(logging.INFO):
        assert probe.apply(kwargs=kwargs, task_id="t-error").get() == "error"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(r.getMessage(), r.exc_info[1].args) for r in errors] == [("probe task of round r-4 failed", ("boom",))]


def test_a_teacher_round_handed_back_logs_one_line_too(caplog):
    """The teacher task's hand-back (the worker drains) is the same kind: one line, no Celery traceback."""
    import base64
    import logging

    from celery import Celery
    from prometheus_client import CollectorRegistry

    from probe_worker.teacher import TeacherMetrics, register_teacher_task
    from wire.teacher_messages import TeacherTask

    drain = DrainState()
    drain.set_operator_drain(True)
    app = Celery("teacher-hand-back-test", broker="memory://", set_as_current=False)
    teacher = register_teacher_task(app, None, TeacherMetrics(CollectorRegistry()), drain)  # never reaches a runtime
    kwargs = TeacherTask(run="kd", teacher_dir="/nowhere", teacher_sha256="0" * 64, rank=0, step=4, key=1, batch=1,
                         seq_len=2, ids_b64=base64.b64encode(bytes(8)).decode(), kind="topk", k=4, temperature=1.0,
                         seed=0).model_dump(mode="json")
    with caplog.at_level(logging.INFO):
        assert teacher.apply(kwargs=kwargs, task_id="t-kd").state == "REJECTED"
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records if r.levelno >= logging.INFO] == [
        ("INFO", "teacher task t-kd handed back to its queue: teacher round kd step 4: not taking tasks "
         "(operator_drain)", None)]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # compiling: ~1 min
def test_a_cut_lands_within_one_block_of_a_segmented_forward(compiled):
    """Beside an engine the worker's forward is segmented (probe_kernels.FastForward(segmented=True): each block
    compiled on its own, the pre-hooks run between blocks): a fire during block 1 stops the forward at block 2's
    start, compiled or not, and the fire costs no recompile (the hook is not traced into the compiled blocks)."""
    import torch._dynamo

    from probe_kernels.compiled_forward import FastForward, is_segment, repeated_blocks
    from support.fleet import make_batch
    from support.models import tiny_gpt2
    from trainer.models.losses import lm_batch_loss

    torch._dynamo.reset()
    model = tiny_gpt2(n_layer=4)
    ff = FastForward(model, lm_batch_loss, compile=compiled, segmented=True)
    blocks = repeated_blocks(ff.shadow)
    assert ff.segments == 4 and blocks == list(ff.shadow.transformer.h) and all(map(is_segment, blocks))
    assert not ff.cuda_graphs and not any(map(is_segment, model.modules()))  # the model itself is left untouched
    batch = make_batch(2, 16, seed=3)
    want = lm_batch_loss(model, batch)
    guard = Preemption()
    handle = guard.install()
    ran: list[int] = []
    try:
        assert torch.equal(ff(batch), want) if not compiled else torch.allclose(ff(batch), want, atol=1e-5)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        fire_after = [1]  # once, at block 1's end
        for i, block in enumerate(blocks):
            block.register_forward_hook(lambda m, a, o, i=i: ran.append(i) or (
                guard.fire() and fire_after.pop() if fire_after == [i] else None))
        guard.arm()
        with pytest.raises(Preempted):
            ff(batch)
        assert ran == [0, 1]  # block 2 never started: the cut landed within one block of the fire
        ran.clear()
        ff(batch)  # fired once: the next forward runs to its end, on the same compiled blocks
        assert ran == [0, 1, 2, 3] and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    finally:
        guard.disarm()
        handle.remove()
