"""probe_worker.freeze: the watcher that stops a worker (SIGSTOP) while its serving engine serves during a task.

The state machine with exact transitions; then real processes: a worker stand-in that holds a real FreezeLink (a real
watcher process, real memfd, real signals, /proc) beside a real HTTP endpoint answering as vLLM's /load does."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from probe_worker.freeze import (
    SHARED,
    FreezeOrders,
    Watcher,
    is_stopped,
    pending_signals,
    process_state,
    watcher_rates,
)
from probe_worker.serving import ServingLedger, ServingPolicy
from support.paths import ROOT


def _watcher(max_s: float = 5.0) -> tuple[Watcher, list[tuple[int, int]], mmap.mmap]:
    shared = mmap.mmap(-1, SHARED.size)
    sent: list[tuple[int, int]] = []
    orders = FreezeOrders(pid=4242, fd=0, policy=ServingPolicy(metrics_url="http://127.0.0.1:1/load"), interval_s=0.05,
                          stopped_interval_s=0.05, max_s=max_s)
    return Watcher(orders, shared, send=lambda pid, sig: sent.append((pid, sig))), sent, shared


def test_watcher_stops_only_a_task_while_busy_and_continues_it_when_idle():
    w, sent, shared = _watcher()
    w.step(0.0, busy=True, task=False)  # no task: nothing to stop
    w.step(0.1, busy=False, task=True)  # a task, engine idle
    assert sent == []
    SHARED.pack_into(shared, 0, 100.0, 0.0)
    w.step(0.2, busy=True, task=True)
    assert sent == [(4242, signal.SIGSTOP)] and SHARED.unpack_from(shared, 0)[1] > 0.0  # the task's first stop
    first = SHARED.unpack_from(shared, 0)[1]
    w.step(0.3, busy=True, task=True)  # still busy: still stopped, no second signal
    w.step(0.4, busy=False, task=True)
    assert sent == [(4242, signal.SIGSTOP), (4242, signal.SIGCONT)]
    w.step(0.5, busy=True, task=True)  # stopped again; the first stop is what the task keeps
    assert sent[-1] == (4242, signal.SIGSTOP) and SHARED.unpack_from(shared, 0)[1] == first


def test_watcher_never_holds_a_pending_signal_and_gives_up_after_max_s_until_idle():
    w, sent, _ = _watcher(max_s=1.0)
    usr1 = frozenset({signal.SIGUSR1})
    w.step(0.0, busy=True, task=True)
    w.step(0.1, busy=True, task=True, pending=usr1)  # a drain waits for the worker: continue it at once
    w.step(0.2, busy=True, task=True)  # and not again in this busy spell: it acts on the signal
    assert [s for _, s in sent] == [signal.SIGSTOP, signal.SIGCONT]
    w.step(0.3, busy=False, task=True)
    w.step(0.4, busy=True, task=True)
    w.step(1.39, busy=True, task=True)
    assert [s for _, s in sent][-1] == signal.SIGSTOP
    w.step(1.4, busy=True, task=True)  # stopped for max_s: continued, it cuts the task itself
    w.step(1.5, busy=True, task=True)  # not stopped again in this busy spell
    assert [s for _, s in sent][2:] == [signal.SIGSTOP, signal.SIGCONT]
    w.step(1.6, busy=False, task=True)
    w.step(1.7, busy=True, task=True)  # a new spell: stopped again
    assert [s for _, s in sent][-1] == signal.SIGSTOP
    w.thaw()
    w.thaw()  # idempotent
    assert [s for _, s in sent][-2:] == [signal.SIGSTOP, signal.SIGCONT]


def test_a_worker_asked_to_end_is_continued_and_never_stopped_again():
    w, sent, _ = _watcher()
    w.step(0.0, busy=True, task=True)
    w.step(0.1, busy=True, task=True, pending=frozenset({signal.SIGTERM}))  # its warm shutdown waits for the task
    for t in (0.2, 0.3, 0.5, 0.6):
        w.step(t, busy=t != 0.3, task=True)  # busy spells after it: never stopped again
    assert [s for _, s in sent] == [signal.SIGSTOP, signal.SIGCONT]


def test_pending_signals_are_read_from_proc_without_the_stop_signals():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _until(lambda: process_state(child.pid) == "S")
        child.send_signal(signal.SIGSTOP)
        assert _until(lambda: is_stopped(child.pid))
        assert pending_signals(child.pid) == frozenset()
        child.send_signal(signal.SIGTERM)  # pending while it is stopped
        assert pending_signals(child.pid) == frozenset({signal.SIGTERM})
        child.send_signal(signal.SIGCONT)
        assert child.wait(30) == -signal.SIGTERM
        assert pending_signals(child.pid) == frozenset()  # gone (a reaped process)
    finally:
        child.kill()
        child.wait(30)


def test_only_a_session_leader_gets_a_watcher():
    code = "from probe_worker.freeze import why_no_watcher; print(why_no_watcher())"
    run = {"capture_output": True, "text": True, "cwd": ROOT, "timeout": 60, "check": True,
           "env": {**os.environ, "PYTHONPATH": str(ROOT)}}
    assert subprocess.run([sys.executable, "-c", code], start_new_session=True, **run).stdout.strip() == "None"
    for popen in ({}, {"process_group": 0}):  # a script's child, a shell's job
        assert "setsid -w" in subprocess.run([sys.executable, "-c", code], **popen, **run).stdout
    # PID 1 of a PID namespace (a container's init), which a SIGSTOP from inside the namespace cannot stop
    ns = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                        **{**run, "check": False})
    if ns.returncode != 0:
        pytest.skip(f"no PID namespace here: {ns.stderr.strip()[:200]}")
    assert "PID 1 of its container" in ns.stdout


def test_watcher_rates_follow_the_workers_watch_and_never_outlast_a_stop():
    assert watcher_rates(0.05, 0.2, 10.0) == (0.05, 0.2)
    assert watcher_rates(None, 0.5, 10.0) == (0.5, 0.5)
    assert watcher_rates(None, 20.0, 10.0) == (10.0, 10.0)  # a long --control-interval: valid orders still
    FreezeOrders(pid=7, fd=3, policy=ServingPolicy(metrics_url="http://x/load"), interval_s=10.0,
                 stopped_interval_s=10.0, max_s=10.0)


def test_orders_are_strict():
    with pytest.raises(ValueError):
        FreezeOrders.model_validate_json('{"pid": 7, "fd": 3, "policy": {"metrics_url": "http://x/load"}, '
                                         '"interval_s": 0.1, "stopped_interval_s": 0.1, "max_s": 1, "extra": 1}')
    for bad in ("0.0", "-1", "1e9"):
        with pytest.raises(ValueError):
            FreezeOrders(pid=7, fd=3, policy=ServingPolicy(metrics_url="http://x/load"), interval_s=0.1,
                         stopped_interval_s=0.1, max_s=bad)
    out = subprocess.run([sys.executable, "-m", "probe_worker.freeze", "{}"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "bad orders" in out.stderr


def test_ledger_counts_a_watcher_stop_as_the_reclaim_once():
    led = ServingLedger()
    led.update(0.0, idle=True, yielding=False, busy_s=0.0, task_running=True, last_task_end=None)
    # the watcher stopped the task at 0.15 and continued it when the engine was idle again: this worker's readings
    # never saw the request; the reclaim is the stop - the last reading before it
    assert led.update(1.0, idle=True, yielding=False, busy_s=0.2, task_running=True, last_task_end=None,
                      stopped_at=0.15) == pytest.approx(0.15)
    assert led.update(1.5, idle=True, yielding=False, busy_s=0.7, task_running=True, last_task_end=None,
                      stopped_at=0.15) is None  # counted once
    # a reading saw the next request first (pending from 1.5); the watcher's stop at 1.6 ends it, not the task's end
    assert led.update(2.0, idle=False, yielding=True, busy_s=0.8, task_running=True, last_task_end=None,
                      stopped_at=0.15) is None
    assert led.update(2.5, idle=False, yielding=True, busy_s=0.8, task_running=True, last_task_end=None,
                      stopped_at=1.6) == pytest.approx(0.1)
    assert led.update(3.0, idle=False, yielding=True, busy_s=0.8, task_running=False, last_task_end=2.9,
                      stopped_at=1.6) is None  # its end is not a second reclaim
    assert led.reclaim_count == 2


# ---- real processes -------------------------------------------------------------------------------------------------

class _Engine:
    """vLLM's /load over real HTTP ({"server_load": N}); `load` is what it answers."""

    def __init__(self) -> None:
        engine = self
        self.load = self.reads = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                engine.reads += 1
                body = json.dumps({"server_load": engine.load}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/load"


# A worker stand-in: a real FreezeLink; commands on stdin ("start", "end", "stop?", "quit"); spins between them.
WORKER = """
import json, select, sys, time
from pathlib import Path
from probe_worker.freeze import FreezeLink
from probe_worker.serving import ServingPolicy
link = FreezeLink(ServingPolicy(metrics_url=sys.argv[1]), (0.05, 0.5), float(sys.argv[2]), Path(sys.argv[3]))
print(json.dumps({"watcher": link.proc.pid}), flush=True)
try:
    while True:
        if select.select([sys.stdin], [], [], 0)[0]:
            cmd = sys.stdin.readline().strip()
            if cmd == "start":
                link.task_started()
            elif cmd == "end":
                link.task_ended()
            elif cmd == "stop?":
                print(json.dumps({"stopped_at": link.stopped_at(), "now": time.time()}), flush=True)
            else:
                break
finally:
    link.close()
"""


def _until(what, timeout_s: float = 120.0) -> bool:  # a liveness bound only
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.02)
    return False


def _ask(proc: subprocess.Popen, cmd: str) -> dict | None:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline()) if cmd.endswith("?") else None


@pytest.fixture
def worker(tmp_path):
    engine, procs = _Engine(), []

    def start(max_s: float = 30.0) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, engine.url, str(max_s), str(tmp_path / "trace")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        procs.append(proc)
        return proc, json.loads(proc.stdout.readline())["watcher"]

    yield engine, start, tmp_path / "trace"
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    engine.server.shutdown()


def test_a_real_worker_is_stopped_while_the_engine_serves_its_task_and_continued_after(worker):
    engine, start, trace = worker
    proc, watcher = start()
    engine.load = 1
    time.sleep(0.5)  # ten readings: no task, so never stopped
    assert not is_stopped(proc.pid)
    _ask(proc, "start")
    assert _until(lambda: is_stopped(proc.pid))
    t0, reads = time.monotonic(), engine.reads
    time.sleep(1.5)
    reads, took = engine.reads - reads, time.monotonic() - t0
    # stopped: read every 0.5 s, not at the running rate (0.05 s: 30 readings in 1.5 s); bounded by the span this
    # test measured around the count (a loaded machine stretches the sleep), plus the reading then in flight
    assert reads <= took / 0.5 + 2
    engine.load = 0
    assert _until(lambda: not is_stopped(proc.pid))
    report = _ask(proc, "stop?")
    assert 0 < report["stopped_at"] <= report["now"]
    events = [json.loads(line)["event"] for line in trace.read_text().splitlines()]
    assert events == ["freeze", "thaw"]
    _ask(proc, "end")
    engine.load = 2
    time.sleep(0.5)  # its task ended: not stopped
    assert not is_stopped(proc.pid)
    _ask(proc, "start")
    assert _until(lambda: is_stopped(proc.pid))
    os.kill(proc.pid, signal.SIGTERM)  # pending while it is stopped: the watcher continues it, and it ends
    assert proc.wait(60) == -signal.SIGTERM
    assert _until(lambda: process_state(watcher) in (None, "Z"))  # its parent gone: it ends


def test_a_stop_ends_after_max_s_and_the_watcher_never_leaves_it_stopped(worker):
    engine, start, trace = worker
    proc, watcher = start(max_s=0.5)
    _ask(proc, "start")
    engine.load = 1
    assert _until(lambda: is_stopped(proc.pid))
    assert _until(lambda: not is_stopped(proc.pid))  # max_s: continued while the engine still serves
    time.sleep(0.5)
    assert not is_stopped(proc.pid)  # and not stopped again in that busy spell
    engine.load = 0
    reads = engine.reads
    # the busy spell ends once the watcher reads idle: the first reading counted from here answered 0, and the one
    # after it began after that answer arrived (one client, one reading at a time)
    assert _until(lambda: engine.reads >= reads + 2)
    engine.load = 1
    assert _until(lambda: is_stopped(proc.pid))  # a new spell
    os.kill(watcher, signal.SIGTERM)  # the watcher ends: it continues the worker on its way out
    assert _until(lambda: not is_stopped(proc.pid))
    assert pending_signals(proc.pid) == frozenset()
    _ask(proc, "quit")
    assert proc.wait(60) == 0
