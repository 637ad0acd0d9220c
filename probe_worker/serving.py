"""Engine-aware yielding: a worker beside a serving engine takes tasks only while the engine is idle.

The worker reads the co-located engine's Prometheus endpoint every control interval (`EngineProbe`), sums the
engine's queue gauges (requests running + waiting) and feeds the sum to `EngineGate`, a pure state machine:

- load > `busy_above` (default 0: any request running or waiting): yield at once;
- load <= `busy_above`: resume only after `hold_s` of idle readings in a row (hysteresis: a burst's gaps between
  requests are shorter than the hold, so the worker does not flap in and out of them);
- endpoint unreadable (refused, timeout, HTTP error, no known gauge, a non-finite value): yield, and count it.
  Why yield: the worker borrows capacity the engine owns. Not seeing the engine, it cannot know whether requests
  wait; yielding costs the fleet only throughput (the coordinator re-dispatches, other workers take the rounds),
  running blind could cost serving latency, the figure an operator lends the device on.

When the gate turns to yield while a task runs, the task is cut short (`install_preemption`: a global forward pre-hook
raises `Preempted` at the next module call of the task's forward passes; the worker hands the task back to the queue,
so its round is re-issued and evaluated once, elsewhere or here after the hold; a pure-ZO ledger replay, in a task or
the prefetch thread, stops between entries while yielding and keeps the entries done, WeightCache.interrupt). So a task
runs at most one control interval plus one module's forward (or one ledger entry's replay) past a request's arrival. Not cut: a snapshot's weight load, and a compiled forward (torch.compile, CUDA),
which ends its whole forward first.

`ServingLedger` keeps the figures (seconds yielded, the engine's idle seconds, the idle seconds the worker used,
reclaim latencies); they go to the worker's metrics and heartbeat (wire.messages.ServingFigures).

Metric names (each engine's own documentation): vLLM `vllm:num_requests_running`, `vllm:num_requests_waiting`;
SGLang (`--enable-metrics`) `sglang:num_running_reqs`, `sglang:num_queue_reqs`; TGI `tgi_batch_current_size`,
`tgi_queue_size`; llama.cpp (`--metrics`) `llamacpp:requests_processing`, `llamacpp:requests_deferred`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from probe_worker.task_trace import TraceFile
from wire.messages import ServingFigures

log = logging.getLogger("sparecycles.worker")

ENGINE_GAUGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}
Engine = Literal["auto", "vllm", "sglang", "tgi", "llamacpp"]
RECLAIMS_KEPT = 1024  # recent reclaim latencies the p95 is taken over


class ServingPolicy(BaseModel):
    """How a worker yields to a co-located serving engine (`sparecycles worker --serving-metrics URL ...`).

    metrics_url: the engine's Prometheus endpoint (e.g. http://127.0.0.1:8000/metrics).
    engine: whose gauges to sum ("auto": the first engine of ENGINE_GAUGES with a gauge in the scrape).
    gauges: other gauge names to sum instead (any engine); non-empty overrides `engine`.
    busy_above: the engine is busy while the summed gauges exceed this (requests; 0: any request).
    hold_s: seconds of idle readings in a row before the worker resumes (hysteresis).
    scrape_timeout_s: one scrape's timeout (connect + read); slower counts as unreadable (and yields).
    interval_s: seconds between two readings (None: the worker's control interval). The gate sees a request at most
    this long after the endpoint does, so it bounds reclaim latency; a reading of vLLM's /load costs ~2 ms.
    freeze_s: the longest a watcher process stops the worker (SIGSTOP) while the engine serves during a task
    (probe_worker.freeze; at most a third of the coordinator's lease, for the heartbeats); 0: no watcher, a task is
    only cut in process.

    A JSON endpoint (reply `application/json`) is read as vLLM's `/load` ({"server_load": N}, with vLLM started with
    `--enable-server-load-tracking`): the API server counts a request there when it arrives, whereas vLLM's
    /metrics gauges count it only after the engine's first step on it (its whole prefill: measured 0.43-1.04 s on this
    CPU, docs/serving.md). `engine` and `gauges` apply to Prometheus text only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics_url: HttpUrl
    engine: Engine = "auto"
    gauges: tuple[Annotated[str, Field(min_length=1, max_length=200)], ...] = ()
    busy_above: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)] = 0.0
    hold_s: Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)] = 2.0
    scrape_timeout_s: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 0.5
    interval_s: Annotated[float | None, Field(ge=0.01, le=10.0, allow_inf_nan=False)] = None
    freeze_s: Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)] = 10.0

    def gauge_names(self, available: set[str]) -> tuple[str, ...]:
        """The gauges to sum, given the metric family names of a scrape (for `engine="auto"`); () if none."""
        if self.gauges:
            return self.gauges
        if self.engine != "auto":
            return ENGINE_GAUGES[self.engine]
        for names in ENGINE_GAUGES.values():
            if available.intersection(names):
                return names
        return ()


class Unreadable(ValueError):
    """The engine's metrics could not be read or gave no usable load; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def engine_load(text: str, policy: ServingPolicy) -> float:
    """The engine's load: the sum of the policy's gauges over all their samples (labels: engines, models) in a
    Prometheus text exposition `text`. Units: requests.

    Raises Unreadable("parse") for text the Prometheus parser refuses, ("no_gauge") when none of the gauges is
    present, ("non_finite") for a NaN/inf or negative sample.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise Unreadable("parse", str(exc)[:200]) from None
    names = [n for n in policy.gauge_names(set(families)) if n in families]
    if not names:
        raise Unreadable("no_gauge", f"none of {policy.gauge_names(set(families)) or ENGINE_GAUGES} in the scrape")
    total = 0.0
    for name in names:
        for sample in families[name].samples:
            if not math.isfinite(sample.value) or sample.value < 0:
                raise Unreadable("non_finite", f"{sample.name} = {sample.value}")
            total += sample.value
    return total


def server_load(text: str) -> float:
    """The load in a JSON reply of vLLM's `/load` ({"server_load": N}: requests the API server holds). Units: requests.

    Raises Unreadable("parse") for text that is not a JSON object, ("no_gauge") without "server_load", ("non_finite")
    for a value that is not a finite number >= 0.
    """
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise Unreadable("parse", str(exc)[:200]) from None
    if not isinstance(body, dict) or "server_load" not in body:
        raise Unreadable("no_gauge", "no server_load in the JSON reply (vLLM: --enable-server-load-tracking)")
    value = body["server_load"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise Unreadable("non_finite", f"server_load = {value!r}")
    return float(value)


class EngineProbe:
    """Reads the engine's load over HTTP (httpx, the policy's timeout, no retries: the next tick is the retry).

    `read()` returns the load (requests) or raises Unreadable with reason "unreachable", "http" or engine_load's
    (server_load's for a JSON reply).
    """

    def __init__(self, policy: ServingPolicy) -> None:
        import httpx

        self.policy = policy
        self._httpx = httpx
        self._client = httpx.Client(timeout=policy.scrape_timeout_s)

    def read(self) -> float:
        """One scrape's load. Raises Unreadable."""
        try:
            reply = self._client.get(str(self.policy.metrics_url))
        except self._httpx.HTTPError as exc:
            raise Unreadable("unreachable", f"{type(exc).__name__}: {exc}") from None
        if reply.status_code != 200:
            raise Unreadable("http", f"HTTP {reply.status_code}")
        if reply.headers.get("content-type", "").startswith("application/json"):
            return server_load(reply.text)
        return engine_load(reply.text, self.policy)

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


class EngineGate:
    """The yield decision, a pure function of timestamped readings (unit-tested with exact values).

    `update(now, load)`: `now` in seconds (any monotonic clock), `load` in requests or None for an unreadable
    endpoint; returns True while the worker must yield. Starts yielding: it resumes only after `hold_s` of idle
    readings, the first of which starts the clock.
    """

    def __init__(self, busy_above: float, hold_s: float) -> None:
        self.busy_above, self.hold_s = busy_above, hold_s
        self.yielding = True
        self.idle_since: float | None = None

    def update(self, now: float, load: float | None) -> bool:
        """Record one reading; return whether to yield now."""
        if load is None or load > self.busy_above:
            self.yielding, self.idle_since = True, None
        else:
            if self.idle_since is None:
                self.idle_since = now
            if now - self.idle_since >= self.hold_s:
                self.yielding = False
        return self.yielding


class ServingLedger:
    """The serving figures, integrated reading by reading (seconds; a pure function of what it is fed).

    Per interval between two readings at t0 < t1: `yielded_s` += t1 - t0 if the worker yielded over it (the
    decision taken at t0); `engine_idle_s` += t1 - t0 if both readings saw the engine idle; `idle_used_s` += the
    worker's busy seconds in it (`busy_s` is the worker's cumulative busy time, read at each reading) when both
    readings saw it idle. Reclaim latency: at the first busy reading after an idle one (a request arrived after
    t0), if a task was running, the latency is (that task's end, or its stop by the freeze watcher if earlier) - t0,
    an upper bound on arrival -> device free; if none was running it is 0 (the engine had the device). A stop by the
    watcher (`stopped_at`, the running task's first, probe_worker.freeze) that no busy reading preceded (the watcher
    saw the request first, and this worker's readings only after it) is a reclaim too: `stopped_at` - the last
    reading before it.
    """

    def __init__(self) -> None:
        self.yielded_s = self.engine_idle_s = self.idle_used_s = 0.0
        self.reclaims: deque[float] = deque(maxlen=RECLAIMS_KEPT)
        self.reclaim_count = 0
        self._last: tuple[float, bool, bool, float] | None = None  # (t, idle, yielding, busy_s)
        self._pending_from: float | None = None  # t0 of a reclaim waiting for the running task to end
        self._counted_stop: float | None = None  # the watcher's stop already counted as a reclaim

    def update(self, now: float, idle: bool, yielding: bool, busy_s: float, task_running: bool,
               last_task_end: float | None, stopped_at: float | None = None) -> float | None:
        """Record one reading (`now`, `last_task_end` and `stopped_at` on one clock); returns a reclaim latency
        completed now."""
        done = None
        if stopped_at is not None and stopped_at != self._counted_stop:
            since = self._pending_from if self._pending_from is not None else self._last[0] if self._last else None
            if since is not None and stopped_at >= since:  # the watcher stopped the task after the request came
                self._counted_stop = stopped_at
                done = self._reclaimed(stopped_at - since)
        if done is None and self._pending_from is not None and not task_running and last_task_end is not None:
            done = self._reclaimed(max(0.0, last_task_end - self._pending_from))
        if self._last is not None:
            t0, was_idle, was_yielding, busy0 = self._last
            dt = max(0.0, now - t0)
            self.yielded_s += dt if was_yielding else 0.0
            if was_idle and idle:
                self.engine_idle_s += dt
                self.idle_used_s += min(dt, max(0.0, busy_s - busy0))
            if was_idle and not idle and self._pending_from is None and done is None:
                if task_running:
                    self._pending_from = t0
                else:
                    done = self._reclaimed(0.0)
        self._last = (now, idle, yielding, busy_s)
        return done

    def _reclaimed(self, latency: float) -> float:
        self.reclaims.append(latency)
        self.reclaim_count += 1
        self._pending_from = None
        return latency

    def reclaim_p95(self) -> float | None:
        """The 95th percentile (nearest rank) of the recent reclaim latencies, None before any."""
        if not self.reclaims:
            return None
        ordered = sorted(self.reclaims)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class ServingWatch:
    """The worker's side of engine-aware yielding: one `tick()` per control interval reads the engine, updates the
    gate, drains or resumes the worker (`DrainState.set_engine_busy`), cuts a running task while yielding, and keeps the
    ledger and the metrics. `figures()` is the heartbeat's part.

    drain: the worker's probe_worker.tasks.DrainState; metrics: its WorkerMetrics; probe: where loads come from
    (default: EngineProbe(policy)); trace: where the gate's changes go (TraceFile.event: "yield" with the reading's
    unix start, its scrape seconds, the load and whether a task was cut; "resume" with the process CPU seconds spent
    while yielding and "idle_since", the unix start of the first idle reading of the hold it ends), None: nowhere.
    """

    def __init__(self, policy: ServingPolicy, drain, metrics, probe: EngineProbe | None = None,
                 trace: TraceFile | None = None) -> None:
        self.policy, self.drain, self.metrics, self.trace = policy, drain, metrics, trace
        self._cpu_at_yield = time.process_time()
        self.probe = probe or EngineProbe(policy)
        self.gate = EngineGate(policy.busy_above, policy.hold_s)
        self.ledger = ServingLedger()
        self.scrape_errors = 0
        self._last_error = ""
        self._sent = (0.0, 0.0, 0.0)  # ledger totals already added to the counters
        self._load_busy = False  # the last reading saw requests (not unreadable)
        self._seen_stop: float | None = None  # the freeze watcher's last stop this watch has seen (unix s)
        self._last_tick: float | None = None  # the last reading's monotonic time

    def tick(self, now: float | None = None) -> bool:
        """One reading (`now`: monotonic seconds); returns whether the worker yields now."""
        now = time.monotonic() if now is None else now
        wall = time.time()
        try:
            load: float | None = self.probe.read()
            self.metrics.serving_load.set(load)
            self._last_error = ""
        except Unreadable as exc:
            load = None
            self.scrape_errors += 1
            self.metrics.serving_errors.labels(exc.reason).inc()
            if exc.reason != self._last_error:  # one line per kind of failure, not one per tick
                log.warning("serving engine metrics unreadable (%s); yielding until they read idle", exc)
                self._last_error = exc.reason
        scrape_s = time.time() - wall
        guard = self.drain.preemption
        stop = guard.watcher_stop()  # unix s -> this reading's monotonic clock
        stopped_at = None if stop is None else now - (wall - stop)
        frozen = stop if stop is not None and stop != self._seen_stop else None
        if frozen is not None:
            self._seen_stop = frozen
            if self._last_tick is None or stopped_at >= self._last_tick:
                # the watcher stopped the worker since the last reading: the engine was busy then, which these readings,
                # made by a stopped process, may not have seen; the gate holds and cuts as if they had
                self.gate.update(stopped_at, math.inf)
        yielding = self.gate.update(now, load)
        cut = guard.fire() if yielding else False  # a running task stops at its next module call
        if yielding != self.drain.engine_busy:
            idle_since = None if self.gate.idle_since is None else wall - (now - self.gate.idle_since)
            self._changed(yielding, wall, scrape_s, load, cut, frozen, idle_since)
        self.drain.set_engine_busy(yielding)
        idle = load is not None and load <= self.policy.busy_above
        self._load_busy = load is not None and not idle
        self._last_tick = now
        new_stop = stopped_at if frozen is not None else None  # each stop once (told apart by its unix time)
        latency = self.ledger.update(now, idle, yielding, guard.busy_s(now), guard.armed, guard.last_end, new_stop)
        if latency is not None:
            self.metrics.serving_reclaim.observe(latency)
        totals = (self.ledger.yielded_s, self.ledger.engine_idle_s, self.ledger.idle_used_s)
        for counter, new, old in zip((self.metrics.serving_yielded, self.metrics.serving_idle,
                                      self.metrics.serving_used), totals, self._sent):
            counter.inc(new - old)
        self._sent = totals
        return yielding

    def _changed(self, yielding: bool, wall: float, scrape_s: float, load: float | None, cut: bool,
                 frozen: float | None = None, idle_since: float | None = None) -> None:
        """Log a gate change and trace it (class docstring)."""
        log.info("serving engine %s; %s", "busy" if yielding else f"idle for {self.policy.hold_s:g} s",
                 "yielding" if yielding else "taking tasks again")
        cpu = time.process_time()
        if yielding:
            self._cpu_at_yield = cpu
        if self.trace is not None:
            extra = {"scrape_s": scrape_s, "load": load, "cut": cut, "frozen": frozen} if yielding else {
                "cpu_s": cpu - self._cpu_at_yield, "idle_since": idle_since}
            self.trace.event("yield" if yielding else "resume", wall, **extra)

    def figures(self) -> ServingFigures:
        """The ledger's figures for the heartbeat (wire.messages.ServingFigures)."""
        led = self.ledger
        return ServingFigures(yielded_s=led.yielded_s, engine_idle_s=led.engine_idle_s, idle_used_s=led.idle_used_s,
                              reclaim_p95_s=led.reclaim_p95(), reclaims=led.reclaim_count,
                              scrape_errors=self.scrape_errors)

    def next_wait(self, fast_s: float, slow_s: float) -> float:
        """Seconds to the next reading: `slow_s` while no task runs and the worker yields to a busy engine or is
        drained otherwise (SIGUSR1, the coordinator, the GPU policy), else `fast_s`. Why: every reading costs the
        engine CPU (~2 ms on vLLM's /load, which its API server answers); while it is busy only its return to idle
        is looked for (the hold that follows is longer than a slow wait, and once idle is read the readings are fast
        again), and a drained worker takes no task whatever it reads. While the worker may compute, a request must
        be seen at once (reclaim latency)."""
        calm = (self.drain.engine_busy and self._load_busy) or self.drain.drained
        return slow_s if calm and not self.drain.preemption.armed else fast_s

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick until `stop` is set (the worker's serving thread), then close: every policy.interval_s seconds (default
        `interval_s`, the worker's control interval), and every max(that, `interval_s`) while yielding to a busy
        engine or drained (`next_wait`)."""
        fast = self.policy.interval_s or interval_s
        slow = max(fast, interval_s)
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except Exception as exc:  # noqa: BLE001 - never let the watch die: yield and retry next tick
                    log.exception("serving watch tick failed: %s", exc)
                    self.drain.set_engine_busy(True)
                stop.wait(self.next_wait(fast, slow))
        finally:
            self.probe.close()
