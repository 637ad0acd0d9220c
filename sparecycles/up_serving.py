"""`up --serving vllm`: a real vLLM beside `up`'s workers, an open-loop request load against it, and its figures.

`serving_beside(demo, out, log)` starts the engine (probe_worker.engine.VllmProcess: `tools/vllm.sh start` on
SmolLM2-135M, the folder trainer.models.pretrained.smollm2_dir() writes, with --enable-server-load-tracking so its
/load counts a request when it arrives), waits for /health, measures the engine alone (one warm-up request, then a
short block of `alone_count` requests at the load's rate, before any worker or trainer starts: `measure_alone`) and
yields a `ServingRun`, whose `worker_args` every worker `up` starts gets (`--serving-metrics <engine>/load
--serving-hold S --serving-interval I`). When the fleet-probed run starts (after the AdamW baseline, whose steps send
the workers no probe task), once every worker reads the engine idle, `up` starts the request load on a thread
(`start_load`; benchmarks.serving_load: Poisson arrivals, prompts and output lengths from a real text); it reads the
workers' serving figures from their last heartbeats (`read_workers`) before it stops them. On leaving, at the runs'
end, it stops sending and waits up to LOAD_DRAIN_S for the requests in flight (after Ctrl-C or an error, not at all),
stops the engine and writes `serving.json` into the run folder (`figures`: the load's time to first token and end to
end p50/p95/p99, every request, and the workers' figures, wire.messages.ServingFigures; the engine-alone block's
percentiles and `p95_vs_alone`, the load's p95 over the alone block's: what serving lost beside `up`, trainer included
on a CPU host). The requests not yet due when the runs end are never sent: serving.json counts them
(`requests_unsent`, with the seconds the load ran and those its arrivals span) and the summary line says how many of
those planned were sent and why not all (`load_summary`).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_load import (
    CONTEXT,
    Outcome,
    Request,
    make_requests,
    outcome_dict,
    percentiles,
    run_load,
    verses,
)
from fleet.attach import FleetError, active_workers
from probe_worker.engine import EngineError, VllmProcess, vllm_installed, vllm_python
from sparecycles.services import free_port
from sparecycles.up_options import SERVING_JSON, ServingDemo

LOAD_DRAIN_S = 120.0  # seconds the end of `up` waits for the requests in flight before it stops the engine
WORKERS_BESIDE_S = 60.0  # seconds the load waits for the workers to read the engine idle (then starts anyway)
LOAD_SEED = 0  # the load's arrivals and passages (benchmarks.serving_load.make_requests)
WORKER_FIGURES = ("yielded_s", "engine_idle_s", "idle_used_s")  # summed over the workers
ALONE_SHARE, ALONE_MIN = 1 / 3, 6  # the engine-alone block: a third of --serving-requests, at least 6 (alone_count)
RUNS_ENDED, STOPPED_EARLY = "the runs ended", "up stopped early (an error or Ctrl-C)"  # what ended the load


def alone_count(requests: int) -> int:
    """Requests of the engine-alone block sent before the fleet starts, for a load of `requests`: a third of them,
    at least ALONE_MIN (a short block: its p95 is nearly its slowest request)."""
    return max(ALONE_MIN, math.ceil(requests * ALONE_SHARE))


def split_requests(n: int, alone: int, rate: float, seed: int) -> tuple[Request, list[Request], list[Request]]:
    """One warm-up request, `alone` requests for the engine-alone block and `n` for the load, from one Poisson schedule
    at `rate` over consecutive passages (benchmarks.serving_load.make_requests: no prompt repeats, so the engine's
    prefix cache helps neither block); each block's arrivals start from 0 again."""
    made = make_requests(1 + alone + n, rate, seed, verses((1 + alone + n) * CONTEXT + 1))

    def rebased(reqs: list[Request], since: float) -> list[Request]:
        return [replace(r, at_s=r.at_s - since) for r in reqs]

    return (replace(made[0], at_s=0.0), rebased(made[1:1 + alone], made[0].at_s),
            rebased(made[1 + alone:], made[alone].at_s))


def p95_ratio(with_s: dict[str, float | None], alone_s: dict[str, float | None]) -> float | None:
    """The load's p95 over the engine-alone block's (seconds over seconds); None when either is missing or 0."""
    a, b = with_s.get("p95"), alone_s.get("p95")
    return a / b if a is not None and b else None


def check_engine(demo: ServingDemo | None) -> None:
    """Raise ValueError (naming the fix) when `demo`'s engine cannot start here: the vLLM venv is missing or its
    install did not finish."""
    if demo is not None and not vllm_installed():
        raise ValueError(f"--serving {demo.engine}: no vLLM venv at {vllm_python().parent.parent}; run `bash "
                         "tools/vllm.sh install` first (once, 3.5 GB)")


@dataclass
class ServingRun:
    """The engine and request load `serving_beside` started; `outcomes` (the load's requests sent) once it ended,
    `workers` (one ServingFigures dict per worker, with its name) once `read_workers` ran."""

    demo: ServingDemo
    engine: VllmProcess
    model: str  # the engine's model id (GET /v1/models)
    requests: list[Request]
    log: Callable[[str], None]
    alone_requests: list[Request] = field(default_factory=list)  # the engine-alone block (measure_alone)
    warmup: Request | None = None  # sent once before that block, not counted
    alone: list[Outcome] = field(default_factory=list)  # the engine-alone block's requests sent
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    started_at: float | None = None  # unix seconds the load began (start_load), None if it never did
    stopped_at: float | None = None  # unix seconds it was told to send no more (end_load)
    ended_by: str = RUNS_ENDED  # what told it to stop (serving_beside: STOPPED_EARLY on an error or Ctrl-C)

    @property
    def worker_args(self) -> tuple[str, ...]:
        """The `sparecycles worker` options that make a worker yield to this engine."""
        return ("--serving-metrics", self.engine.load_url, "--serving-hold", f"{self.demo.hold_s:g}",
                "--serving-interval", f"{self.demo.interval_s:g}", "--nice", str(self.demo.nice))

    def measure_alone(self) -> None:
        """Send the warm-up request, then the engine-alone block at the load's rate, and wait for their answers (the
        engine has nothing else to do: no worker, trainer or load has started)."""
        if self.warmup is not None:
            run_load(self.engine.url, self.model, [self.warmup])
        self.log(f"engine alone: {len(self.alone_requests)} requests at {self.demo.rate:g}/s before the fleet starts "
                 f"(~{self.alone_requests[-1].at_s if self.alone_requests else 0:.0f} s of arrivals)")
        self.alone = run_load(self.engine.url, self.model, self.alone_requests, stop=self.stop)

    def start_load(self, base: str, admin_token: str, workers: int) -> None:
        """Start sending the requests (on a thread) once `workers` workers of the coordinator at `base` take tasks
        beside the engine (`wait_workers_beside`); idempotent."""
        if self.thread is not None:
            return
        self.wait_workers_beside(base, admin_token, workers)

        def load() -> None:
            self.outcomes = run_load(self.engine.url, self.model, self.requests, stop=self.stop)

        self.thread = threading.Thread(target=load, name="serving-load", daemon=True)
        self.started_at = time.time()
        self.thread.start()
        self.log(f"request load: {self.demo.requests} requests at {self.demo.rate:g}/s against {self.engine.url}, "
                 f"their arrivals over ~{self.planned_s:.0f} s (those not yet due when the runs end are not sent); "
                 f"every worker yields to {self.engine.load_url} (hold {self.demo.hold_s:g} s)")

    @property
    def planned_s(self) -> float:
        """Seconds from the load's start to its last request's arrival (the Poisson schedule of make_requests)."""
        return self.requests[-1].at_s if self.requests else 0.0

    def wait_workers_beside(self, base: str, admin_token: str, workers: int) -> None:
        """Wait up to WORKERS_BESIDE_S seconds until `workers` workers' heartbeats say they read the engine idle
        for the hold (so they take tasks: the load's first request is one they yield to); after that, log and go
        on. Transient coordinator errors are retried."""
        deadline = time.monotonic() + WORKERS_BESIDE_S
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, FleetError):
                seen = [w for w in active_workers(base, admin_token)
                        if (w.get("serving") or {}).get("engine_idle_s", 0.0) >= self.demo.hold_s]
                if len(seen) >= workers:
                    return
            time.sleep(0.2)
        self.log(f"warning: not every worker read the engine idle in {WORKERS_BESIDE_S:.0f} s; the load starts anyway")

    def read_workers(self, base: str, admin_token: str) -> None:
        """The workers' serving figures from their last heartbeats (GET /v1/workers at the coordinator `base`); kept
        as they were when the coordinator does not answer; by name."""
        with contextlib.suppress(httpx.HTTPError, FleetError):
            self.workers = sorted(({"name": w["name"], **w["serving"]} for w in active_workers(base, admin_token)
                                   if w.get("serving")), key=lambda w: w["name"])  # one order, whatever the listing's

    def end_load(self, drain_s: float) -> None:
        """Send no more requests; wait up to `drain_s` seconds for those in flight."""
        self.stop.set()
        if self.started_at is not None and self.stopped_at is None:
            self.stopped_at = time.time()
        if self.thread is not None:
            self.thread.join(drain_s)

    def figures(self) -> dict[str, Any]:
        """serving.json: the load (requests planned, sent, not sent, answered, failed; the seconds its arrivals span
        and the seconds it ran, None if it never started; TTFT and end-to-end percentiles in seconds), the workers'
        figures (seconds yielded, the engine's idle seconds, those the worker used, reclaim p95) and their sums with
        `idle_used_share`, the engine-alone block (`alone`) and `p95_vs_alone` (p95_ratio), and every request of
        both."""
        ok = answered(self.outcomes)
        alone = _block(self.alone)
        ttft, e2e = (percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
                     percentiles([o.e2e_s for o in ok if o.e2e_s is not None]))
        totals = {k: sum(w.get(k, 0.0) for w in self.workers) for k in WORKER_FIGURES}
        idle = totals["engine_idle_s"]
        ran = None if self.started_at is None else (self.stopped_at or time.time()) - self.started_at
        return {
            "engine": self.demo.engine, "model": str(self.engine.model_dir), "load_url": self.engine.load_url,
            "rate_per_s": self.demo.rate, "requests_planned": len(self.requests), "hold_s": self.demo.hold_s,
            "requests_sent": len(self.outcomes), "requests_unsent": len(self.requests) - len(self.outcomes),
            "load_planned_s": self.planned_s, "load_ran_s": ran, "load_ended_by": self.ended_by,
            "answered": len(ok), "failed": len(self.outcomes) - len(ok),
            "ttft_s": ttft, "e2e_s": e2e, "alone": alone,
            "p95_vs_alone": {"ttft_s": p95_ratio(ttft, alone["ttft_s"]), "e2e_s": p95_ratio(e2e, alone["e2e_s"])},
            "workers": self.workers,
            "workers_total": {**totals, "idle_used_share": totals["idle_used_s"] / idle if idle else None},
            "engine_log": str(self.engine.log_path), "requests": [outcome_dict(o) for o in self.outcomes],
            "requests_alone": [outcome_dict(o) for o in self.alone],
        }


def answered(outcomes: list[Outcome]) -> list[Outcome]:
    """The requests answered in full (no error, a last token)."""
    return [o for o in outcomes if not o.error and o.end is not None]


def _block(outcomes: list[Outcome]) -> dict[str, Any]:
    """The engine-alone block's figures: requests sent, answered, failed; TTFT and end-to-end percentiles (s)."""
    ok = answered(outcomes)
    return {"requests_sent": len(outcomes), "answered": len(ok), "failed": len(outcomes) - len(ok),
            "ttft_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
            "e2e_s": percentiles([o.e2e_s for o in ok if o.e2e_s is not None])}


def _start(demo: ServingDemo, out: Path, log: Callable[[str], None]) -> ServingRun:
    """Start the engine, wait for its /health and make the load's requests. Raises RuntimeError (naming the engine's
    log) when the engine exits or does not answer in probe_worker.engine.HEALTH_TIMEOUT_S; the engine is stopped then."""
    from trainer.models.pretrained import smollm2_dir

    engine = VllmProcess(smollm2_dir(), free_port(), out / "logs" / "vllm.log",
                         extra_args=["--enable-server-load-tracking"])
    engine.start()
    try:
        log(f"vLLM on {engine.url} (log {engine.log_path}); waiting for /health ...")
        warmup, alone, requests = split_requests(demo.requests, alone_count(demo.requests), demo.rate, LOAD_SEED)
        engine.wait_ready()
        model = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    except EngineError as exc:
        engine.stop()
        raise RuntimeError(f"--serving {demo.engine}: the engine did not come up (log {engine.log_path}): "
                           f"{exc}") from None
    except BaseException:
        engine.stop()
        raise
    return ServingRun(demo, engine, model, requests, log, alone_requests=alone, warmup=warmup)


def _finish(run: ServingRun, out: Path, drain_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """End the load (waiting `drain_s` s for requests in flight), stop the engine, write serving.json; its figures."""
    try:
        run.end_load(drain_s)
    finally:
        run.engine.stop()
    if run.thread is not None:
        run.thread.join(30.0)  # the engine's end fails the streams left: run_load returns
    figures = run.figures()
    (out / SERVING_JSON).write_text(json.dumps(figures, indent=1))
    log(f"{serving_line(figures)} ({out / SERVING_JSON})")
    return figures


def serving_line(figures: dict[str, Any]) -> str:
    """serving.json's figures in one line: the requests answered, TTFT and end-to-end p50/p95 (s), p95 end to end
    against the engine alone, and the share of the engine's idle seconds the workers used."""
    t, e, w = figures["ttft_s"], figures["e2e_s"], figures["workers_total"]
    fmt = "{:.2f}".format
    ratio, alone = figures["p95_vs_alone"], figures["alone"]
    vs = ("no engine-alone figure" if ratio["e2e_s"] is None else
          f"p95 {ratio['e2e_s']:.2f}x end to end, {ratio['ttft_s'] or 0:.2f}x TTFT, of the engine alone "
          f"({fmt(alone['e2e_s']['p95'] or 0)}/{fmt(alone['ttft_s']['p95'] or 0)} s, {alone['answered']} requests)")
    share = w.get("idle_used_share")
    return (f"serving: {load_summary(figures)}; TTFT p50/p95 {fmt(t['p50'] or 0)}/{fmt(t['p95'] or 0)} s, end to end "
            f"{fmt(e['p50'] or 0)}/{fmt(e['p95'] or 0)} s; {vs}; workers yielded {w['yielded_s']:.1f} s, used "
            f"{w['idle_used_s']:.1f} of the engine's {w['engine_idle_s']:.1f} idle s"
            + (f" ({share:.0%})" if share is not None else ""))


def load_summary(figures: dict[str, Any]) -> str:
    """The summary's words on the load (`ServingRun.figures`): the requests answered of those sent, and, when not all
    planned were sent, how many were and why (the runs ended before the rest were due, or the load never started)."""
    sent, planned, answered = figures["requests_sent"], figures["requests_planned"], figures["answered"]
    done = f"{answered}/{sent} requests answered ({figures['failed']} failed)"
    if sent == planned:
        return done
    if figures["load_ran_s"] is None:
        why = ("the fleet-probed run, with which it starts, did not train this time" if figures["load_ended_by"] ==
               RUNS_ENDED else f"{figures['load_ended_by']} before the fleet-probed run it starts with")
        return f"0 of {planned} requests sent: the load never started ({why})"
    return (f"{sent} of {planned} requests sent: {figures['load_ended_by']} {figures['load_ran_s']:.0f} s into the "
            f"load, whose arrivals at {figures['rate_per_s']:g}/s span ~{figures['load_planned_s']:.0f} s (fewer "
            f"--serving-requests or a higher --serving-rate fit a shorter run); {done}")


@contextlib.contextmanager
def serving_beside(demo: ServingDemo | None, out: Path, log: Callable[[str], None]) -> Iterator[ServingRun | None]:
    """The engine and load of `demo` (None: nothing, yields None) for the duration of the block (module docstring).
    Raises RuntimeError when the engine does not come up."""
    if demo is None:
        yield None
        return
    run = _start(demo, out, log)
    drain_s = 0.0
    try:
        run.measure_alone()
        yield run
        drain_s = LOAD_DRAIN_S
    except BaseException:
        run.ended_by = STOPPED_EARLY
        raise
    finally:
        _finish(run, out, drain_s, log)
