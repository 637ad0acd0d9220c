"""`bench churn`'s measurements and figures: samples of a running arm, the coordinator's state at its end, and the
report (churn.json) and plot (churn.png) over every arm (benchmarks.churn runs them).

Figures per arm: wall time (and its ratio to the same policy without churn), tasks re-issued by reason and rounds
re-issued (a deadline re-issue at least once), results wasted (posted, evaluated, and not accepted: duplicate,
closed_round, same_worker, stale, ...), rounds lost (incomplete at the end and neither skipped by the trainer's policy
nor still out when it ended), results counted twice (accepted stream events of one seed of one round, retractions
taken off), join -> first task (a joined worker's ready line to its first task received, from its log), kill ->
re-issue (a kill, term or stop to the next deadline re-issue, from the samples), and for `sync` whether every
logged loss equals the in-process run's bit for bit.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

ACCEPTED = ("accepted", "held")


@cache
def _redis(url: str):
    import redis

    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)


def _keys(site):
    from coordinator.keys import Keys

    return Keys(site.prefix, f"{site.prefix}.probe")


def add_counts(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Counters `a` + `b`, by name and label value (a name or label in one only keeps its value)."""
    out = {name: dict(labels) for name, labels in a.items()}
    for name, labels in b.items():
        for label, v in labels.items():
            out.setdefault(name, {})[label] = out.get(name, {}).get(label, 0.0) + v
    return out


def counters(http) -> dict[str, dict[str, float]]:
    """The coordinator's counters by name and label value (the one label each has), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                label = next(iter(s.labels.values()), "")
                out.setdefault(s.name, {})[label] = s.value
    return out


def sample(http, site, runs: set[str], t: float) -> dict[str, Any]:
    """One sample of a running arm at `t` s: active workers, rounds open, deadline re-issues so far; adds the runs
    seen to `runs` (a run leaves the coordinator's list when it ends)."""
    r, k = _redis(site.redis_url), _keys(site)
    runs |= set(r.smembers(k.k_runs))
    workers = [w for w in http.get("/v1/workers", params={"limit": 1000}).json() if w["state"] == "active"]
    open_rounds = sum(r.scard(k.k_run(run, "rounds:open")) for run in runs)
    reissued = add_counts(site.counted, counters(http)).get("sparecycles_tasks_redispatched_total", {})
    return {"t": round(t, 2), "workers": len(workers), "active": sorted(w["name"] for w in workers),
            "rounds_open": open_rounds,
            "deadline_reissues": reissued.get("deadline", 0.0)}


def snapshot(http, site, runs: set[str]) -> dict[str, Any]:
    """The coordinator's state at an arm's end: counters, and per run its rounds (seeds, done, re-issued) and its
    stream's events (accepted per round and seed, retracted, dropped)."""
    r, k = _redis(site.redis_url), _keys(site)
    from coordinator.keys import results_stream_key

    rounds, accepted, retracted, dropped = [], Counter(), Counter(), 0
    for run in sorted(runs):
        for rid in sorted(r.smembers(k.k_run(run, "rounds"))):
            n, done = r.hmget(k.k_round(run, rid), ["n_seeds", "done"])
            rounds.append({"run": run, "round": rid, "n_seeds": int(n or 0), "done": int(done or 0),
                           "reissued": int(r.get(k.k_round(run, rid, "speculated")) or 0)})
        for _, fields in r.xrange(results_stream_key(site.prefix, run)):
            ev = json.loads(fields["e"])
            key = f"{run}/{ev['round_id']}/{ev.get('seed')}"
            if ev["kind"] == "accepted":
                accepted[key] += 1
            elif ev["kind"] == "retracted":
                retracted[key] += 1
            elif ev["kind"] == "dropped":
                dropped += 1
    doubled = sum(max(0, n - retracted[key] - 1) for key, n in accepted.items())
    return {"metrics": counters(http), "rounds": rounds, "seeds_accepted": len(accepted), "doubled": doubled,
            "dropped_events": dropped}


def _stamp(line: str) -> float | None:
    """Unix time of a worker log line: Celery's `[YYYY-mm-dd HH:MM:SS,mmm: ...` or logging's `YYYY-mm-dd HH:MM:SS,mmm
    ...` (local time, as this process's clock reads it)."""
    text = line[1:24] if line.startswith("[") else line[:23]
    try:
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def join_to_first_task(log: Path) -> float | None:
    """Seconds from a joined worker's ready line ("ready on": registered, consuming) to its first task received,
    from its log; None when it got none (stopped first, or no task was waiting: then it idles until the next
    round, which is not a join latency)."""
    ready = None
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if ready is None and "ready on" in line:
            ready = _stamp(line)
        elif ready is not None and "] received" in line and (t := _stamp(line)) is not None:
            return round(t - ready, 3)
    return None


def kill_to_reissue(events: list[dict], timeline: list[dict]) -> list[float]:
    """Seconds from a kill, term or stop to the first sample whose deadline re-issues grew, when that comes before
    the next such event (a removal of a worker that held no task re-issues nothing: left out)."""
    removals = [ev["t"] for ev in events if ev["event"] in ("kill", "term", "stop")]
    out: list[float] = []
    for t, t_next in zip(removals, [*removals[1:], float("inf")][: len(removals)], strict=True):
        before = [s["deadline_reissues"] for s in timeline if s["t"] <= t]
        base = before[-1] if before else 0.0
        later = [s["t"] for s in timeline if t < s["t"] <= t_next and s["deadline_reissues"] > base]
        if later:
            out.append(round(later[0] - t, 2))
    return out


def _losses(run_dir: Path) -> list[tuple[int, str, float]]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], key, r[key]) for r in recs for key in ("loss", "val_loss") if key in r]


def mean_active(timeline: list[dict]) -> float | None:
    """Workers active at the coordinator, averaged over the arm's wall time (each sample held until the next one);
    None with fewer than two samples. What churn left of the pool: a wall ratio near calm/this is lost capacity, not
    overhead."""
    if len(timeline) < 2:
        return None
    spans = [(b["t"] - a["t"], len(a["active"])) for a, b in itertools.pairwise(timeline)]
    return round(sum(dt * n for dt, n in spans) / sum(dt for dt, _ in spans), 2)


def figures(arm: dict, reference: Path | None) -> dict[str, Any]:
    """The figures of one arm's raw record (benchmarks.churn.run_arm)."""
    final, run_dir = arm["final"], Path(arm["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    skipped = summary.get("rounds_skipped", {})
    outcomes = final["metrics"].get("sparecycles_intake_results_total", {})
    incomplete = sum(1 for rd in final["rounds"] if rd["done"] < rd["n_seeds"])
    out = {
        "wait": arm["wait"], "churn": arm["churn"], "wall_s": round(arm["wall_s"], 1),
        "events": Counter(e["event"] for e in arm["events"]),
        "rounds": len(final["rounds"]),
        "rounds_reissued": sum(1 for rd in final["rounds"] if rd["reissued"]),
        "tasks_reissued": final["metrics"].get("sparecycles_tasks_redispatched_total", {}),
        "results_wasted": {k: v for k, v in outcomes.items() if k not in ACCEPTED and v},
        "results_wasted_total": sum(v for k, v in outcomes.items() if k not in ACCEPTED),
        "spot_copies_dropped": final["metrics"].get("sparecycles_spot_copies_dropped_total", {}),
        "rounds_incomplete": incomplete, "trainer_rounds_skipped": skipped,
        "rounds_lost": max(0, incomplete - int(skipped.get("dropped", 0)) - int(skipped.get("pending_at_end", 0))),
        "results_counted_twice": final["doubled"],
        "join_to_first_task_s": [j for w in arm["joined"] if (j := join_to_first_task(Path(arm["logs"]) / f"{w}.log"))
                                 is not None],
        "joined": len(arm["joined"]),
        "kill_to_reissue_s": kill_to_reissue(arm["events"], arm["timeline"]),
        "final_val_loss": summary.get("final_val_loss"),
        "mean_active_workers": mean_active(arm["timeline"]),
    }
    if arm["wait"] == "sync" and reference is not None:
        out["bit_equal_to_in_process"] = _losses(run_dir) == _losses(reference)
    return out


def report(o, arms: list[dict], reference: Path | None) -> dict[str, Any]:
    """churn.json: the options, every arm's figures (wall against the same policy without churn), the events."""
    figs = [figures(a, reference) for a in arms]
    calm = {f["wait"]: f["wall_s"] for f in figs if not f["churn"]}
    for f in figs:
        if f["churn"] and f["wait"] in calm:
            f["wall_vs_no_churn"] = round(f["wall_s"] / calm[f["wait"]], 3)
    ref = json.loads((reference / "summary.json").read_text()) if reference is not None else {}
    return {"options": json.loads(o.model_dump_json()), "work": str(Path(arms[0]["run_dir"]).parent.parent), "in_process_final_val_loss": ref.get("final_val_loss"),
            "arms": figs, "events": {f"{a['wait']}-{'churn' if a['churn'] else 'calm'}": a["events"] for a in arms},
            "timelines": {f"{a['wait']}-{'churn' if a['churn'] else 'calm'}": a["timeline"] for a in arms}}


def plot(arms: list[dict], path: Path) -> None:
    """churn.png: per churn arm, active workers and rounds open over time, each event a vertical mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not arms:
        return
    fig, axes = plt.subplots(len(arms), 1, figsize=(9, 2.6 * len(arms)), squeeze=False, sharex=False)
    colors = {"kill": "red", "term": "orange", "stop": "purple", "cont": "gray", "join": "green", "yield": "gold",
              "restart": "blue"}
    for ax, arm in zip(axes[:, 0], arms, strict=True):
        t = [s["t"] for s in arm["timeline"]]
        ax.step(t, [s["workers"] for s in arm["timeline"]], where="post", label="workers active")
        ax.step(t, [s["rounds_open"] for s in arm["timeline"]], where="post", label="rounds in flight")
        for ev in arm["events"]:
            ax.axvline(ev["t"], color=colors.get(ev["event"], "black"), alpha=0.4, lw=1)
        ax.set_title(f"--fleet-wait {arm['wait']}: events (red kill, orange term, purple stop, gray cont, green join, "
                     "gold yield, blue coordinator restart)", fontsize=9)
        ax.set_ylabel("count")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the trainer started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
