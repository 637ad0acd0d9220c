"""`sparecycles bench serving`'s figures from what a run recorded (benchmarks.serving): a worker's task spans and gate
events from its trace, the freeze watcher's stops cut out of them, each arm's latency percentiles, throughput, engine
idle share used and reclaim latencies, and the paired p95 ratios to the engine alone. Pure functions; times in unix
seconds."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serving_load import overlap, percentiles, union


def worker_trace(path: Path | None, t0: float, t1: float) -> tuple[list[tuple[float, float, str]], list[dict]]:
    """A worker's computing task spans (done or preempted) that overlap [t0, t1], clipped to it, and its gate events
    (probe_worker.task_trace.TraceFile.event) in [t0 - 1, t1]. A cut task's span ends when its evaluation stopped (the
    check that raised); its hand-back after that (Celery's requeue, at the worker's low priority while the engine
    runs) is an event, {"event": "hand_back", "t": its end, "stopped": s}. The seconds the freeze watcher held the
    worker stopped (its "freeze" to its next "thaw" event, probe_worker.freeze) are taken out of the spans: a stopped
    task computes nothing."""
    if path is None or not path.exists():
        return [], []
    spans, events = [], []
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if s.get("outcome") in ("done", "preempted") and s["end"] > t0 and s["start"] < t1:
            end = s.get("stopped", s["end"])
            spans.append((max(s["start"], t0), min(end, t1), s["outcome"]))
            if "stopped" in s:
                events.append({"event": "hand_back", "t": s["end"], "stopped": s["stopped"]})
        elif "event" in s and t0 - 1 <= s["t"] <= t1:
            events.append(s)
    return minus_frozen(spans, frozen_intervals(events, t1)), events


def frozen_intervals(events: list[dict], t1: float) -> list[tuple[float, float]]:
    """The [freeze, thaw] intervals of a worker's events (unix s, in time order; a freeze with no thaw after it lasts
    to `t1`)."""
    out, since = [], None
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "freeze" and since is None:
            since = e["t"]
        elif e["event"] == "thaw" and since is not None:
            out.append((since, e["t"]))
            since = None
    return out + ([(since, t1)] if since is not None else [])


def minus_frozen(spans: list[tuple[float, float, str]], frozen: list[tuple[float, float]]
                 ) -> list[tuple[float, float, str]]:
    """`spans` (start, end, outcome) with the `frozen` intervals cut out of them: a span a stop interrupts becomes
    two, one ending at the stop (its kind: "done", as the task went on) and one from the continue."""
    out = []
    for a, b, kind in spans:
        pieces = [(a, b)]
        for f0, f1 in frozen:
            pieces = [p for x, y in pieces for p in ((x, min(y, f0)), (max(x, f1), y)) if p[1] > p[0]]
        out += [(x, y, kind if y == b else "done") for x, y in pieces]
    return out


def _reclaims(ok, spans, events) -> tuple[list[float], list[float], list[float]]:
    """Per request that arrived while a task ran: the task's end (or the freeze watcher's stop) minus the arrival;
    split, where the worker traced its gate, into detect (arrival -> the end of the first reading that turned the gate
    to yield after it, or the watcher's stop) and cut (that -> the task's end; 0 for a stop)."""
    total, detect, cut = [], [], []
    seen = sorted([e["t"] + e.get("scrape_s", 0.0) for e in events if e["event"] == "yield"]
                  + [e["t"] for e in events if e["event"] == "freeze"])
    for o in ok:
        for a, b, _ in spans:
            if a < o.sent < b:
                total.append(b - o.sent)
                knew = next((t for t in seen if t >= o.sent), None)
                if knew is not None and knew <= b + 1.0:
                    detect.append(knew - o.sent)
                    cut.append(max(0.0, b - knew))
    return total, detect, cut


def arm_figures(blocks) -> dict:
    """Latency percentiles, throughput, idle share used and reclaim latencies of one arm over its blocks, each
    (outcomes, worker spans, t0, t1[, gate events]) in unix seconds. Engine idle: block time outside every answered
    request's [sent, end]; used: the worker's task time in it; reclaim: per request that arrived while a task ran, the
    task's end minus the arrival (with events: split into detect and cut, `_reclaims`); hand_back: a cut task's
    stop to its hand-back's end."""
    hand_back: list[float] = []
    ok_all, reclaim, detect, cut_s, seconds, idle_s, task_s, used_s, cut, tokens, n = [], [], [], [], 0.0, 0.0, 0.0, \
        0.0, 0, 0, 0
    for outs, spans, t0, t1, *rest in blocks:
        ok = [o for o in outs if not o.error and o.end is not None]
        busy = union([(o.sent, o.end) for o in ok])
        work = [(a, b) for a, b, _ in spans]
        seconds += t1 - t0
        idle_s += (t1 - t0) - sum(b - a for a, b in busy)
        task_s += sum(b - a for a, b in union(work))
        used_s += sum(b - a for a, b in union(work)) - overlap(work, busy)
        r, d, c = _reclaims(ok, spans, rest[0] if rest else [])
        hand_back += [e["t"] - e["stopped"] for e in (rest[0] if rest else []) if e["event"] == "hand_back"]
        reclaim, detect, cut_s = reclaim + r, detect + d, cut_s + c
        cut += sum(1 for *_, k in spans if k == "preempted")
        tokens += sum(o.tokens for o in ok)
        ok_all += ok
        n += len(outs)
    return {
        "requests": n, "errors": n - len(ok_all), "seconds": seconds, "blocks": len(blocks),
        "ttft_s": percentiles([o.ttft_s for o in ok_all if o.ttft_s is not None]),
        "e2e_s": percentiles([o.e2e_s for o in ok_all]),
        "output_tokens_per_s": tokens / max(1e-9, seconds), "output_tokens": tokens,
        "engine_idle_s": idle_s, "worker_task_s": task_s, "idle_used_s": used_s,
        "idle_used_share": used_s / idle_s if idle_s > 0 else None, "tasks_cut": cut,
        "reclaim_s": percentiles(reclaim), "reclaims": len(reclaim),
        "reclaim_detect_s": percentiles(detect), "reclaim_cut_s": percentiles(cut_s),
        "hand_back_s": percentiles(hand_back),
    }


def _pairs(blocks: list[dict], base: list[dict], picks: list[int], key: str) -> tuple[list[float], list[float]]:
    """`key` latencies of the requests of blocks `picks` answered in both arms: (this arm's, arm (a)'s)."""
    both = [(r[key], q[key]) for i in picks for r, q in zip(blocks[i]["requests"], base[i]["requests"])
            if r[key] is not None and q[key] is not None]
    return [x for x, _ in both], [y for _, y in both]


def _p95_ratio(pair: tuple[list[float], list[float]]) -> float:
    return percentiles(pair[0])["p95"] / percentiles(pair[1])["p95"]


def paired_ratios(raw: dict, seed: int, resamples: int = 2000) -> dict:
    """Per arm other than (a), over the requests that every arm was sent alike (`_blocks`) and both answered: the p95
    ratio to arm (a) with a 90% interval from resampling whole blocks with replacement (a block bootstrap: Efron &
    Tibshirani, An Introduction to the Bootstrap, 1993, ch. 8.5; seeded), and the median of the per-request ratios. `raw`: the
    result's {arm: [{"requests": [{"ttft_s", "e2e_s"}, ...]}, ...]}, blocks aligned by index. Unitless."""
    import random

    rng = random.Random(seed)
    n = len(raw["a"])
    draws = [[rng.randrange(n) for _ in range(n)] for _ in range(resamples)]
    out: dict = {}
    for arm, blocks in raw.items():
        if arm == "a":
            continue
        out[arm] = {}
        for key in ("ttft_s", "e2e_s"):
            ratios = sorted(_p95_ratio(_pairs(blocks, raw["a"], d, key)) for d in draws)
            mine, base = _pairs(blocks, raw["a"], list(range(n)), key)
            out[arm][key] = {"p95_ratio": _p95_ratio((mine, base)),
                             "p95_ratio_90ci": (ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]),
                             "median_request_ratio": percentiles([x / y for x, y in zip(mine, base) if y > 0])["p50"],
                             "requests": len(mine)}
    return out
