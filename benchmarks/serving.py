"""`sparecycles bench serving`: what serving loses with a fleet worker beside it, and what engine-aware yielding gets back.

Everything real: vLLM (tools/vllm.sh, SmolLM2-135M, float32) on CPU 0; two worker processes on CPU 0 beside it; a
coordinator and a pure-ZO trainer (`sparecycles train --coordinator`, 1SPSA with K probes per step, 64 by default so a
step leaves a backlog of tasks, on gpt2-tiny, batch 4x64) keeping them busy, and the open-loop load client
(benchmarks.serving_load) on CPU 1 (as on a GPU host the trainer runs on another device). One
worker has no serving policy (it never yields), the other yields (`--serving-metrics` with the chosen hold); both
write their task spans (`--task-trace`). Arms, interleaved in blocks (a, b, c, a, b, c, ...) on the same processes:

- (a) engine alone: both workers drained (SIGUSR1; a drained worker only heartbeats);
- (b) busy worker, no yielding: the first resumed (SIGUSR2), the second drained;
- (c) engine-aware yielding: the second resumed, the first drained.

Per arm: TTFT and end-to-end p50/p95/p99, throughput (output tokens/s), and on the fleet side the probe forward passes
done (worker metrics), the share of the engine's idle seconds (arm time outside every request's [sent, end]) the
worker spent in tasks (its trace), and reclaim latency: per request that arrived while a task ran, that task's end
minus the arrival.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.fleet import ROOT, _Fleet
from benchmarks.serving_load import (
    CONTEXT,
    make_requests,
    outcome_dict,
    overlap,
    percentiles,
    run_load,
    union,
    verses,
)

ARMS = ("a", "b", "c")
SEEDS, CLEAN = "sparecycles_worker_probes_evaluated_total", "sparecycles_worker_clean_evaluations_total"
ENGINE_CPU, FLEET_CPU = 0, 1


def _pin(pid: int, cpu: int) -> None:
    """Pin every thread of process `pid` to `cpu` (taskset -a)."""
    subprocess.run(["taskset", "-a", "-cp", str(cpu), str(pid)], check=True, capture_output=True)


def _scrape(port: int) -> dict[str, float]:
    """A worker's unlabelled and labelled samples as {'name{labels}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def _spans(path: Path, t0: float, t1: float) -> list[tuple[float, float, str]]:
    """A worker's computing task spans (done or preempted) that overlap [t0, t1], clipped to it."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if s["outcome"] in ("done", "preempted") and s["end"] > t0 and s["start"] < t1:
            out.append((max(s["start"], t0), min(s["end"], t1), s["outcome"]))
    return out


def arm_figures(blocks) -> dict:
    """Latency percentiles, throughput, idle share used and reclaim latencies of one arm over its blocks, each
    (outcomes, worker spans, t0, t1) in unix seconds. Engine idle: block time outside every answered request's
    [sent, end]; used: the worker's task time in it; reclaim: per request that arrived while a task ran, the task's
    end minus the arrival."""
    ok_all, reclaim, seconds, idle_s, task_s, used_s, cut, tokens, n = [], [], 0.0, 0.0, 0.0, 0.0, 0, 0, 0
    for outs, spans, t0, t1 in blocks:
        ok = [o for o in outs if not o.error and o.end is not None]
        busy = union([(o.sent, o.end) for o in ok])
        work = [(a, b) for a, b, _ in spans]
        seconds += t1 - t0
        idle_s += (t1 - t0) - sum(b - a for a, b in busy)
        task_s += sum(b - a for a, b in union(work))
        used_s += sum(b - a for a, b in union(work)) - overlap(work, busy)
        reclaim += [b - o.sent for o in ok for a, b, _ in spans if a < o.sent < b]
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
    }


def _trainer(fleet: _Fleet, run_dir: Path, log: Path, probes: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARECYCLES_ADMIN_TOKEN": fleet.admin_token,
           "SPARECYCLES_REDIS_URL": fleet.redis_url, "SPARECYCLES_KEY_PREFIX": fleet.prefix}
    cmd = ["taskset", "-c", str(FLEET_CPU), sys.executable, "-m", "sparecycles.cli", "train", "--model", "gpt2-tiny",
           "--corpus", "classics-small", "--optimizer", "1spsa", "--probes", str(probes), "--batch-size", "4", "--seq-len", "64",
           "--steps", "1000000",
           "--eval-every", "1000000", "--eval-on", "trainer", "--coordinator", fleet.url, "--run-dir", str(run_dir),
           "--no-progress"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def run_serving_bench(redis_url: str, requests: int, rate: float, hold_s: float, interval_s: float, seed: int,
                      out_dir: Path, blocks: int = 4, probes: int = 64, progress=print) -> dict:
    """Start everything, run `blocks` rounds of arms a, b, c (requests // blocks requests each), stop everything;
    returns the result dict (also written to out_dir/serving.json with the raw requests and spans; the plot to
    out_dir/serving.png). SIGTERM stops it cleanly (every process it started)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from api.server import free_port
    from probe_worker.engine import VllmProcess
    from trainer.models.pretrained import smollm2_dir

    os.sched_setaffinity(0, {FLEET_CPU})  # the load client
    text = verses(requests * CONTEXT + 1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    engine = VllmProcess(smollm2_dir(), free_port(), tmp / "vllm.log", cpus=[ENGINE_CPU])
    fleet = trainer = None
    result: dict = {"settings": {"requests_per_arm": requests, "blocks": blocks, "trainer_probes": probes, "rate_per_s": rate, "hold_s": hold_s,
                                 "control_interval_s": interval_s, "seed": seed, "engine_cpu": ENGINE_CPU,
                                 "fleet_cpu": FLEET_CPU}, "arms": {}, "raw": {}}
    try:
        progress("starting vLLM on CPU 0 ...")
        engine.start()
        engine.wait_ready()
        model = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        fleet = _Fleet(redis_url, tmp, threads=1)
        os.sched_setaffinity(fleet.coord.pid, {FLEET_CPU})
        ports, traces = {}, {}
        yielding = ("--serving-metrics", engine.metrics_url, "--serving-hold", str(hold_s))
        for role, extra in (("noyield", ()), ("yield", yielding)):
            ports[role], traces[role] = free_port(), tmp / f"{role}.jsonl"
            fleet.worker_args = ("--task-trace", str(traces[role]), "--metrics-port", str(ports[role]),
                                 "--control-interval", str(interval_s), *extra)
            fleet.start_workers(1)
        for p in fleet.procs:
            _pin(p.pid, ENGINE_CPU)
        noyield, yielder = fleet.procs
        progress(f"starting the trainer (1SPSA K={probes} on gpt2-tiny) on CPU 1 ...")
        trainer = _trainer(fleet, tmp / "run", tmp / "trainer.log", probes)
        time.sleep(5)
        signals = {"a": (signal.SIGUSR1, signal.SIGUSR1), "b": (signal.SIGUSR2, signal.SIGUSR1),
                   "c": (signal.SIGUSR1, signal.SIGUSR2)}
        per_block = max(1, requests // blocks)
        collected: dict[str, list] = {arm: [] for arm in ARMS}
        forwards = dict.fromkeys(ARMS, 0.0)
        for blk in range(blocks):  # interleaved: the machine's other load falls on every arm alike
            for k, arm in enumerate(ARMS):
                noyield.send_signal(signals[arm][0])
                yielder.send_signal(signals[arm][1])
                time.sleep(max(3.0, 2 * hold_s))  # the drains take effect; the yielding worker's hold passes
                if trainer.poll() is not None:
                    raise RuntimeError(f"the trainer exited ({trainer.returncode}); see {tmp / 'trainer.log'}")
                before = {r: _scrape(p) for r, p in ports.items()}
                reqs = make_requests(per_block, rate, seed + 100 * blk + k, text)
                progress(f"block {blk + 1}/{blocks}, arm ({arm}): {per_block} requests at {rate:g}/s ...")
                t0 = time.time()
                outs = run_load(engine.url, model, reqs)
                t1 = time.time()
                after = {r: _scrape(p) for r, p in ports.items()}
                role = {"a": None, "b": "noyield", "c": "yield"}[arm]
                collected[arm].append((outs, _spans(traces[role], t0, t1) if role else [], t0, t1))
                forwards[arm] += sum(2 * (after[r][SEEDS] - before[r][SEEDS]) + after[r][CLEAN] - before[r][CLEAN]
                                     for r in ports)
        for arm in ARMS:
            figures = arm_figures(collected[arm])
            figures["probe_forwards_done"] = forwards[arm]
            result["arms"][arm] = figures
            result["raw"][arm] = [{"t0": t0, "t1": t1, "requests": [outcome_dict(o) for o in outs], "spans": spans}
                                  for outs, spans, t0, t1 in collected[arm]]
        result["heartbeat_serving"] = fleet.info("bench-1")["serving"]
    finally:
        if trainer is not None and trainer.poll() is None:  # a bench's trainer: nothing of it is kept
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
        try:
            if fleet is not None:
                fleet.close()
        finally:
            engine.stop()
    a = result["arms"]
    if "a" in a and "c" in a:
        result["ratios"] = {arm: {k: a[arm][k]["p95"] / a["a"][k]["p95"] for k in ("ttft_s", "e2e_s")}
                            for arm in ("b", "c")}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serving.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "serving.png")
    return result


def plot(result: dict, path: Path) -> None:
    """Latency over time per arm (TTFT and end to end per request, at its arrival; the arm's blocks one after another,
    dotted lines between them), the worker's task spans shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in result["raw"]]
    fig, axes = plt.subplots(len(arms), 1, figsize=(11, 2.6 * len(arms)), sharey=True, squeeze=False)
    titles = {"a": "(a) engine alone", "b": "(b) busy worker, no yielding", "c": "(c) engine-aware yielding"}
    for ax, arm in zip(axes[:, 0], arms):
        offset = 0.0
        for i, blk in enumerate(result["raw"][arm]):
            t0 = blk["t0"] - offset
            for a, b, kind in blk["spans"]:
                ax.axvspan(a - t0, b - t0, color="tab:red" if kind == "preempted" else "tab:orange", alpha=0.3, lw=0)
            ok = [r for r in blk["requests"] if r["e2e_s"] is not None]
            ax.plot([r["sent"] - t0 for r in ok], [r["e2e_s"] for r in ok], "o", ms=4, color="tab:blue",
                    label="end to end" if i == 0 else None)
            ax.plot([r["sent"] - t0 for r in ok], [r["ttft_s"] for r in ok], "x", ms=4, color="tab:green",
                    label="first token" if i == 0 else None)
            offset += blk["t1"] - blk["t0"]
            ax.axvline(offset, color="grey", ls=":", lw=0.8)
        ax.set_xlim(0, offset)
        ax.set_title(titles[arm] + " (shaded: worker tasks; red: cut short)", fontsize=9)
        ax.set_ylabel("latency (s)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds of the arm's blocks (request arrival)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
