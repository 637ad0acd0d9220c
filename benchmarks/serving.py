"""`sparecycles bench serving`: what serving loses with a fleet worker beside it, and what engine-aware yielding gets back.

Everything real: vLLM (tools/vllm.sh, SmolLM2-135M, float32) on CPU 0; two worker processes (three with arm (d))
beside it; a coordinator and a pure-ZO trainer (`sparecycles train --coordinator`, 1SPSA with K probes per step, 64 by default so a
step leaves a backlog of tasks, on gpt2-tiny, batch 4x64) keeping them busy, and the open-loop load client
(benchmarks.serving_load) on CPU 1 (as on a GPU host the trainer runs on another device). One
worker has no serving policy (it never yields), the other yields (`--serving-metrics` with the chosen hold); both
write their task spans (`--task-trace`). Arms, interleaved in blocks on the same processes (the order rotates each
block: a, b, c, then b, c, a, ...), paired (within a block every arm is sent the same requests):

- (a) engine alone: both workers drained (SIGUSR1; a drained worker only heartbeats) and moved to CPU 1 (on a GPU
  host a drained worker holds no device time; here its heartbeats would share the engine's core);
- (b) busy worker, no yielding: the first resumed (SIGUSR2) on CPU 0, the others drained on CPU 1;
- (c) engine-aware yielding: the second resumed on CPU 0, the others drained on CPU 1; with the worker's defaults
  beside an engine, its tasks run at nice 19 and so does its session's autogroup (probe_worker.priority);
- (d) with --nice N and/or --sched-idle: the third, which yields as the second does and runs its tasks at CPU nice N
  (0: unchanged, the ablation of (c)'s priority) and/or under SCHED_IDLE.

Per arm: TTFT and end-to-end p50/p95/p99, throughput (output tokens/s), and on the fleet side the probe forward passes
done (worker metrics), the share of the engine's idle seconds (arm time outside every request's [sent, end]) the
worker spent in tasks (its trace), and reclaim latency: per request that arrived while a task ran, that task's end
minus the arrival. A check on the arms themselves: the drained workers' task seconds in each arm (0 when their
drains held).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import httpx

from benchmarks.fleet import ROOT, _Fleet
from benchmarks.serving_figures import arm_figures, paired_ratios, worker_trace
from benchmarks.serving_llamacpp import LLAMACPP_ARGS, llamacpp_engine
from benchmarks.serving_load import (
    CONTEXT,
    Request,
    make_requests,
    outcome_dict,
    run_load,
    verses,
)
from benchmarks.serving_options import ARMS, ServingBench

ROLES = {"b": "noyield", "c": "yield", "d": "nice"}  # the worker each arm resumes (arm a: none)
SEEDS, CLEAN = "sparecycles_worker_probes_evaluated_total", "sparecycles_worker_clean_evaluations_total"
ENGINE_CPU, FLEET_CPU = 0, 1


def _pin(pid: int, cpu: int) -> None:
    """Pin every thread of process `pid` to `cpu`, twice over (a thread started meanwhile by one not yet pinned).
    A thread that ends meanwhile is skipped: `taskset -a` failed the whole bench on one (a worker's short-lived
    threads). Raises ProcessLookupError if the process itself is gone."""
    if not Path(f"/proc/{pid}").exists():
        raise ProcessLookupError(f"process {pid} is gone")
    for _ in range(2):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cpu})
            except (ProcessLookupError, FileNotFoundError):  # the thread ended
                pass


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


def _trainer(fleet: _Fleet, run_dir: Path, log: Path, cfg: ServingBench) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "SPARECYCLES_ADMIN_TOKEN": fleet.admin_token, "SPARECYCLES_REDIS_URL": fleet.redis_url,
           "SPARECYCLES_KEY_PREFIX": fleet.prefix}
    pin = ["taskset", "-c", str(FLEET_CPU)] if cfg.pinned else []
    cmd = [*pin, sys.executable, "-m", "sparecycles.cli", "train", "--model", "gpt2-tiny", "--device", cfg.train_device,
           "--corpus", "classics-small", "--optimizer", "1spsa", "--probes", str(cfg.probes), "--batch-size",
           str(cfg.train_batch_size), "--seq-len", str(cfg.train_seq_len), "--steps", "1000000", "--eval-every", "1000000",
           "--eval-on", "trainer", "--coordinator", fleet.url, "--run-dir", str(run_dir), "--no-progress"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


class Worker(NamedTuple):
    """One bench worker: its process, metrics port, task trace file and fleet name."""

    proc: subprocess.Popen
    port: int
    trace: Path
    name: str


def _workers(fleet: _Fleet, engine, cfg: ServingBench, tmp: Path, roles: tuple[str, ...]) -> dict[str, Worker]:
    """Start one worker per role of `roles` (noyield; yield; nice), pinned to the engine's CPU; returns {role:
    Worker}."""
    from api.server import free_port

    url = engine.url + ("/load" if cfg.signal == "load" else "/metrics")
    yielding = ("--serving-metrics", url, "--serving-hold", str(cfg.hold),
                *(("--serving-interval", str(cfg.serving_interval)) if cfg.serving_interval else ()))
    lower = (*(("--nice", str(cfg.nice)) if cfg.nice is not None else ()), *(("--sched-idle",) if cfg.sched_idle else ()),
             *(("--serving-freeze", str(cfg.freeze)) if cfg.freeze is not None else ()))
    extra = {"noyield": (), "yield": yielding, "nice": (*yielding, *lower)}
    out = {}
    for role in roles:
        port, trace = free_port(), tmp / f"{role}.jsonl"
        fleet.worker_args = ("--task-trace", str(trace), "--metrics-port", str(port),
                             "--control-interval", str(cfg.control_interval), *extra[role])
        name = fleet.start_workers(1)[0]
        if cfg.pinned:
            _pin(fleet.procs[-1].pid, ENGINE_CPU)
        out[role] = Worker(fleet.procs[-1], port, trace, name)
    return out


def _fleet_and_trainer(fleet: _Fleet, engine, cfg: ServingBench, tmp: Path) -> tuple[dict, subprocess.Popen]:
    """The workers and the trainer. The trainer attaches while one worker is up, so its run has no spot checks and
    one task per round (fleet.attach: a replica must come from another worker, and here only one worker is resumed
    at a time, so spot-checked seeds would wait for hand-backs); the other workers join after."""
    roles = ("noyield", "yield", *(("nice",) if "d" in cfg.arms else ()))
    workers = _workers(fleet, engine, cfg, tmp, roles[:1])
    trainer = _trainer(fleet, tmp / "run", tmp / "trainer.log", cfg)
    deadline = time.monotonic() + 300
    while "active worker(s)" not in (tmp / "trainer.log").read_text(errors="replace"):
        if trainer.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the trainer did not attach; see {tmp / 'trainer.log'}")
        time.sleep(0.5)
    return {**workers, **_workers(fleet, engine, cfg, tmp, roles[1:])}, trainer


def _set_drained(w: Worker, drained: bool, timeout_s: float = 60.0) -> None:
    """Drain (SIGUSR1) or resume (SIGUSR2) worker `w` and wait until its metrics say so. Why wait: Python runs the
    handlers of signals pending together in signal-number order, so a SIGUSR2 followed at once by a SIGUSR1 (the main
    thread inside a long C call) left a worker resumed; one signal at a time, confirmed, cannot. Raises RuntimeError
    after `timeout_s`."""
    w.proc.send_signal(signal.SIGUSR1 if drained else signal.SIGUSR2)
    deadline = time.monotonic() + timeout_s
    while _scrape(w.port).get("sparecycles_worker_draining") != float(drained):
        if w.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {w.name} did not {'drain' if drained else 'resume'} in {timeout_s:g} s")
        time.sleep(0.05)


def _warm(workers: dict, trainer: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Resume each worker alone until it has finished a task (its model built, compiled on CUDA), the others drained;
    then drain all. Raises RuntimeError if the trainer exits or `timeout_s` passes."""
    for role, (_, _, trace, _) in workers.items():
        for other, w in workers.items():
            _set_drained(w, other != role)
        deadline = time.monotonic() + timeout_s
        while not (trace.exists() and '"done"' in trace.read_text()):
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {role} finished no task while warming up (trainer rc {trainer.poll()})")
            time.sleep(0.5)
        _set_drained(workers[role], True)


def block_order(arms: tuple[str, ...], block: int) -> tuple[str, ...]:
    """The arms' order in block `block`: rotated by one each block, so that no arm always follows the same one."""
    k = block % len(arms)
    return arms[k:] + arms[:k]


def _wait_drained(fleet: _Fleet, names: list[str], interval_s: float, timeout_s: float = 120.0) -> None:
    """Wait until the workers `names` have each heartbeat idle (no task running) twice in a row, `interval_s` (their
    control interval) apart: a task a worker started before its drain runs to its end (a drain stops only new tasks),
    on a GPU as long as a version's load. After `timeout_s` go on (the arm's drained_workers_task_s shows it)."""
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 2 and time.monotonic() < deadline:
        listed = fleet.admin.get("/v1/workers").json()  # one read for all of them
        busy = [w["name"] for w in listed if w["name"] in names and w.get("busy")]
        calm = 0 if busy else calm + 1
        time.sleep(interval_s)


def _warm_prompts(url: str, model: str, requests: list[Request], progress) -> None:
    """Send `requests` once, one after another, unmeasured: the arms of a block send the same prompts, so whatever an
    engine does the first time it sees a prompt (vLLM's prefix cache fills; an engine's first run of a shape) would
    otherwise fall on the block's first arm only, which rotates (seen on the GPU stand-in: a block's first arm decoded
    slower). A failed warm-up request is reported and the block goes on."""
    for req in requests:
        for out in run_load(url, model, [replace(req, at_s=0.0)]):
            if out.error:
                progress(f"warm-up request failed: {out.error}")


def _blocks(engine, model: str, fleet: _Fleet, workers: dict, trainer, cfg: ServingBench, text: list[str],
            progress) -> dict:
    """Run the arms interleaved in blocks (the machine's other load falls on every arm alike), paired: within a block
    every arm is sent the same requests (prompts, output lengths, arrival times); returns
    {arm: {"blocks": [(outcomes, spans, t0, t1, events)], "forwards": n, "load": [1-min load averages]}}."""
    per_block = cfg.requests // cfg.blocks  # ServingBench: a multiple of blocks
    got = {arm: {"blocks": [], "forwards": 0.0, "load": [], "others_s": 0.0} for arm in cfg.arms}
    for blk in range(cfg.blocks):
        requests = make_requests(per_block, cfg.rate, cfg.seed + 100 * blk, text)
        if cfg.warmup:
            _warm_prompts(engine.url, model, requests, progress)
        for arm in block_order(cfg.arms, blk):
            for role, w in workers.items():
                mine = ROLES.get(arm) == role
                _set_drained(w, not mine)
                if cfg.pinned:  # a drained worker leaves the engine's core: arm (a) is the engine alone
                    _pin(w.proc.pid, ENGINE_CPU if mine else FLEET_CPU)
            time.sleep(max(3.0, 2 * cfg.hold))  # the drains take effect; the yielding worker's hold passes
            _wait_drained(fleet, [w.name for r, w in workers.items() if ROLES.get(arm) != r], cfg.control_interval)
            if trainer.poll() is not None:
                raise RuntimeError(f"the trainer exited ({trainer.returncode})")
            before = {r: _scrape(w.port) for r, w in workers.items()}
            progress(f"block {blk + 1}/{cfg.blocks}, arm ({arm}): {per_block} requests at {cfg.rate:g}/s ...")
            t0 = time.time()
            outs = run_load(engine.url, model, requests)
            t1 = time.time()
            after = {r: _scrape(w.port) for r, w in workers.items()}
            spans, events = worker_trace(workers[ROLES[arm]].trace if arm in ROLES else None, t0, t1)
            got[arm]["blocks"].append((outs, spans, t0, t1, events))
            got[arm]["others_s"] += sum(b - a for role, w in workers.items() if ROLES.get(arm) != role
                                        for a, b, _ in worker_trace(w.trace, t0, t1)[0])  # drained: must stay 0
            got[arm]["load"].append(os.getloadavg()[0])
            got[arm]["forwards"] += sum(2 * (after[r][SEEDS] - before[r][SEEDS]) + after[r][CLEAN] - before[r][CLEAN]
                                        for r in workers)
    return got


def _result(cfg: ServingBench, got: dict) -> dict:
    """The result dict: settings, per-arm figures (arm_figures + forwards + load averages), raw requests/spans/events,
    and each arm's p95 ratios to arm (a)."""
    result: dict = {"settings": {**cfg.model_dump(mode="json", exclude={"redis_url"}),  # no password in a result
                                  "engine_cpu": ENGINE_CPU, "fleet_cpu": FLEET_CPU,
                                  "engine_args": list({"vllm": VLLM_ARGS, "llamacpp": LLAMACPP_ARGS}.get(
                                      cfg.engine, ()))},
                    "arms": {}, "raw": {}}
    for arm, g in got.items():
        result["arms"][arm] = {**arm_figures(g["blocks"]), "probe_forwards_done": g["forwards"],
                               "drained_workers_task_s": g["others_s"],
                               "load_avg_1min": g["load"]}
        result["raw"][arm] = [{"t0": t0, "t1": t1, "requests": [outcome_dict(o) for o in outs], "spans": spans,
                               "events": events} for outs, spans, t0, t1, events in g["blocks"]]
    a = result["arms"]
    result["ratios"] = {arm: {k: a[arm][k]["p95"] / a["a"][k]["p95"] for k in ("ttft_s", "e2e_s")}
                        for arm in a if arm != "a"}
    result["paired"] = paired_ratios(result["raw"], cfg.seed)
    return result


# vLLM's flags beyond tools/vllm.sh's. /load counts requests on arrival (what a yielding worker reads). Prefix caching
# off: the arms of a block send the same prompts, so with vLLM's default the first arm of each block prefilled its
# ~120-token prompts (~0.28 s to a first token) and the later arms hit the cache (~0.10 s): a swing far larger than
# the worker's cost, which rotated with the arms' order and made time to first token p95 noise (runs before 2026-12-06).
VLLM_ARGS = ("--enable-server-load-tracking", "--no-enable-prefix-caching")


def _engine(cfg: ServingBench, tmp: Path):
    """The engine process (not started): vLLM on SmolLM2-135M pinned to CPU 0 (with /load), llama.cpp behind the
    load proxy, or the stand-in."""
    from api.server import free_port
    from benchmarks.serving_standin import StandinProcess
    from probe_worker.engine import VllmProcess
    from trainer.models.pretrained import smollm2_dir

    if cfg.engine == "llamacpp":
        return llamacpp_engine(cfg, tmp / "engine.log", ENGINE_CPU)
    if cfg.engine == "standin":
        args = ["--config", str(cfg.standin_config), "--device", cfg.device, "--dtype", cfg.standin_dtype,
                *(["--tokenizer", str(cfg.standin_tokenizer)] if cfg.standin_tokenizer else []),
                *(["--threads", "1"] if cfg.pinned else [])]
        return StandinProcess(Path("."), free_port(), tmp / "engine.log", cpus=[ENGINE_CPU] if cfg.pinned else None,
                              extra_args=args)
    return VllmProcess(smollm2_dir(), free_port(), tmp / "vllm.log", cpus=[ENGINE_CPU], extra_args=VLLM_ARGS)


def run_serving_bench(cfg: ServingBench, progress=print) -> dict:
    """Start everything (module docstring), run cfg.blocks rounds of the arms, stop everything; returns the result
    dict (also written to cfg.out/serving.json with the raw requests, spans and gate events; the plot to
    serving.png). SIGTERM stops it cleanly (every process it started)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if cfg.pinned:
        os.sched_setaffinity(0, {FLEET_CPU})  # the load client
    text = verses(cfg.requests * CONTEXT + 1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    engine = _engine(cfg, tmp)
    fleet = trainer = None
    try:
        progress(f"starting {cfg.engine} on {'CPU 0' if cfg.pinned else cfg.device} ...")
        engine.start()
        engine.wait_ready()
        model = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        fleet = _Fleet(cfg.redis_url, tmp, threads=cfg.threads, devices=(cfg.device,))
        if cfg.pinned:
            os.sched_setaffinity(fleet.coord.pid, {FLEET_CPU})
        progress(f"starting the workers and the trainer (1SPSA K={cfg.probes} on gpt2-tiny) on CPU {FLEET_CPU} ...")
        workers, trainer = _fleet_and_trainer(fleet, engine, cfg, tmp)
        _warm(workers, trainer)
        result = _result(cfg, _blocks(engine, model, fleet, workers, trainer, cfg, text, progress))
        # the yielding worker's own figures; None if it no longer heartbeats (its lease expired): the arms still count
        result["heartbeat_serving"] = (fleet.info(workers["yield"].name) or {}).get("serving")
    finally:
        if trainer is not None and trainer.poll() is None:  # a bench's trainer: nothing of it is kept
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
        try:
            if fleet is not None:
                fleet.close()
        finally:
            engine.stop()
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "serving.json").write_text(json.dumps(result, indent=1))
    plot(result, cfg.out / "serving.png")
    return result


def plot(result: dict, path: Path) -> None:
    """Latency over time per arm (TTFT and end to end per request, at its arrival; the arm's blocks one after another,
    dotted lines between them), the worker's task spans shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in result["raw"]]
    fig, axes = plt.subplots(len(arms), 1, figsize=(11, 2.6 * len(arms)), sharey=True, squeeze=False)
    titles = {"a": "(a) engine alone", "b": "(b) busy worker, no yielding", "c": "(c) engine-aware yielding",
              "d": "(d) engine-aware yielding as --nice / --sched-idle / --freeze say"}
    for ax, arm in zip(axes[:, 0], arms):
        offset = 0.0
        for i, blk in enumerate(result["raw"][arm]):
            t0 = blk["t0"] - offset
            for a, b, kind in blk["spans"]:
                ax.axvspan(a - t0, b - t0, color="tab:red" if kind == "preempted" else "tab:orange", alpha=0.3, lw=0)
            yields = [e["t"] + e.get("scrape_s", 0.0) - t0 for e in blk.get("events", []) if e["event"] == "yield"]
            ax.plot(yields, [0.0] * len(yields), "|", ms=8, color="tab:red", label="gate yields" if i == 0 and yields
                    else None)
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
