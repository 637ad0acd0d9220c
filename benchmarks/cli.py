"""`sparecycles bench ...`: the product's benchmarks (typer + stdlib at import; the work is imported inside).

kernels, probe: probe kernels and a probe worker's speed on a GPU (probe_kernels.bench, .bench_probe, beside the
kernels they measure); intake: result intake through Redis (benchmarks.intake); fleet: probe throughput of real
workers (benchmarks.fleet); data-pack, precision; serving, serving-load: latency beside a serving engine
(benchmarks.serving); churn: a trainer on a local fleet whose workers come and go on a seeded
schedule (benchmarks.churn); shares: two runs on a local fleet at stated shares (benchmarks.shares). The
experiments (ZO side by side, the block-type lr regime, the headline report) are not product commands: they live
in experiments/ at the repository root (experiments/README.md).
"""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from benchmarks.churn import ChurnOptions
from benchmarks.options import (
    DataPackOptions,
    FleetBenchOptions,
    IntakeBenchOptions,
    KernelsBenchOptions,
    PrecisionOptions,
    ProbeBenchOptions,
    parse,
)
from benchmarks.segments import SegmentsBench
from benchmarks.serving_options import ServingBench, ServingLoad
from benchmarks.shares import SharesOptions
from trainer.cli_settings import SettingsCommand, with_settings

SECTION = "Options"  # the generated options list with --help's own

bench_app = typer.Typer(help="Benchmarks (kernels, probe, intake, fleet, serving, ...).", no_args_is_help=True)


@with_settings(model=KernelsBenchOptions, param="given", section=SECTION)
def bench_kernels(given: dict) -> None:
    """Effective bandwidth of the fused perturb/replay kernels vs a device copy and naive PyTorch, and the
    per-probe perturbation overhead vs one bf16 forward of gpt2-small. Needs a CUDA GPU."""
    from probe_kernels.bench import render, run_bench

    o = parse(KernelsBenchOptions, given)
    try:
        res = run_bench(list(o.preset), o.dist, o.k, o.batch, o.seq_len, o.forward)
    except (ValueError, RuntimeError) as e:
        raise typer.BadParameter(str(e)) from e
    render(res)
    if o.json_out is not None:
        o.json_out.parent.mkdir(parents=True, exist_ok=True)
        o.json_out.write_text(json.dumps(res, indent=2))
        typer.echo(f"wrote {o.json_out}")


@with_settings(model=ProbeBenchOptions, param="given", section=SECTION)
def bench_probe(given: dict) -> None:
    """A probe worker's speed on one GPU: the compiled whole-model probe path against the per-unit eager
    reference (probes/s, forward MFU against a measured bf16 matmul, end-to-end probe overhead against a
    clean forward of the same compiled model, parity on seeds, determinism). Needs a CUDA GPU."""
    from probe_kernels.bench_probe import render, run_probe_bench

    o = parse(ProbeBenchOptions, given)
    if o.json_out is not None:
        o.json_out.parent.mkdir(parents=True, exist_ok=True)
    try:
        res = run_probe_bench(list(o.preset), o.batch, o.seq_len, o.parity_seeds, o.cuda_graphs, o.cross_process,
                              o.json_out)
    except (ValueError, RuntimeError) as e:
        raise typer.BadParameter(str(e)) from e
    render(res)
    if o.json_out is not None:
        typer.echo(f"wrote {o.json_out}")


@with_settings(model=IntakeBenchOptions, param="given", section=SECTION)
def bench_intake(given: dict) -> None:
    """Results accepted per second end to end through Redis, and p50/p99 latency from publish to acceptance."""
    from benchmarks.intake import result_dict, run_intake_bench

    o = parse(IntakeBenchOptions, given)
    _redis_answers(o.redis_url)
    for m in o.modes:
        res = run_intake_bench(m, o.workers, o.results, o.batch, o.redis_url, o.rate, coordinators=o.coordinators)
        if o.print_json:
            typer.echo(json.dumps(result_dict(res)))
        else:
            typer.echo(
                f"{res.mode:5s} {'rate=' + format(res.rate, '.0f') + ' ' if res.rate else ''}"
                f"{'coordinators=' + str(res.coordinators) + ' ' if res.coordinators > 1 else ''}"
                f"workers={res.workers} batch={res.batch} results={res.results} accepted={res.accepted} "
                f"streamed={res.streamed}  {res.results_per_s:,.0f} results/s  p50={res.p50_ms:.2f} ms  "
                f"p99={res.p99_ms:.2f} ms  ({res.seconds:.2f} s, {os.cpu_count()} CPUs, load {res.load_avg_1m})"
            )
            per = 1e3 / max(res.accepted, 1)
            coord, rds, cli = res.server_cpu_s * per, res.redis_cpu_s * per, res.client_cpu_s * per
            # One coordinator process is one core (GIL); Redis is another. Load-independent capacity:
            capacity = 1e3 / max(coord, rds, 1e-9)
            typer.echo(
                f"      CPU ms/result: coordinator {coord:.3f}, redis {rds:.3f}, simulated workers {cli:.3f} "
                f"-> one coordinator process on a dedicated core (+ Redis on another): ~{capacity:,.0f} results/s"
            )


@with_settings(model=FleetBenchOptions, param="given", section=SECTION)
def bench_fleet(given: dict) -> None:
    """Probes per second with 1, 2, 4 workers (CPU or GPU), and version publish -> every worker ready latency."""
    from benchmarks.fleet import result_dict, run_fleet_bench
    from fleet.devices import device_here, devices_here

    o = parse(FleetBenchOptions, given)  # the devices checked there: here only spelled out ("cuda" -> "cuda:0")
    devs = devices_here(o.device, "--device")
    o = o.model_copy(update={"trainer_device": device_here(o.trainer_device, "--trainer-device")})
    _redis_answers(o.redis_url)

    def save(r) -> None:
        if o.json_out is not None:
            o.json_out.write_text(json.dumps(result_dict(r), indent=1))

    res = run_fleet_bench(o, devs, save)
    save(res)
    if o.print_json:
        typer.echo(json.dumps(result_dict(res)))
        return
    typer.echo(f"{o.preset}, {o.kind} rounds, batch {o.batch_size}x{o.seq_len}, {o.seeds} seeds in tasks of "
               f"{o.seeds_per_task}, {o.threads} thread(s)/worker, {os.cpu_count()} CPUs")
    for n, rate in res.probes_per_s.items():
        typer.echo(f"  {n} worker(s): {rate:8.2f} results/s ({res.forward_passes_per_s[n]:.2f} forward passes/s, "
                   f"{res.tokens_per_s[n] / 1e6:.3f}M tokens/s)")
    if res.ready_preset:
        typer.echo(f"  publish -> every worker ready, {res.ready_preset} ({res.ready_bytes / 2**20:.0f} MiB): "
                   f"{res.publish_to_ready_s:.2f} s (publish itself {res.publish_s:.2f} s; shards by {res.blob_path})")


@with_settings(model=ChurnOptions, param="given", section=SECTION)
def bench_churn(given: dict) -> None:
    """A trainer on a local fleet of CPU workers killed, terminated, stopped past their lease and joined on a seeded
    schedule, per --fleet-wait, with and without churn: wall time, re-issues, wasted results, rounds lost, results
    counted twice, join -> first task, kill -> re-issue, and sync's losses against the in-process run.
    Writes OUT/churn.json and OUT/churn.png."""
    from benchmarks.churn import run_churn_bench

    o = parse(ChurnOptions, given)
    rep = run_churn_bench(o, lambda m: typer.echo(m, err=True))
    for f in rep["arms"]:
        typer.echo(json.dumps({k: v for k, v in f.items() if k != "events"}))
    typer.echo(f"wrote {o.out / 'churn.json'} and {o.out / 'churn.png'}")


@with_settings(model=SharesOptions, param="given", section=SECTION)
def bench_shares(given: dict) -> None:
    """Two runs at stated shares on a local fleet of CPU workers, then the first ends: each run's worker-seconds
    (the coordinator's sparecycles_run_worker_seconds_total) against the shares, and the second run taking the pool.
    Writes OUT/shares.json and OUT/shares.png."""
    from benchmarks.shares import run_shares_bench

    o = parse(SharesOptions, given)
    rep = run_shares_bench(o, lambda m: typer.echo(m, err=True))
    typer.echo(json.dumps(rep["figures"]))
    typer.echo(f"wrote {o.out / 'shares.json'} and {o.out / 'shares.png'}")


def _redis_answers(url: str) -> None:
    """Raise typer.BadParameter (one line, exit 2) naming --redis-url when the Redis at `url` does not answer a PING
    within 5 s: said before any worker or coordinator starts, not as a hang or a traceback later."""
    import redis

    try:
        redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5).ping()
    except (redis.RedisError, ValueError) as exc:  # ValueError: a URL redis cannot read (a port that is no number)
        where = url.split("://", 1)[1].rsplit("@", 1)[-1]  # host:port/db, never a password
        raise typer.BadParameter(f"the Redis at {where} does not answer ({exc}); start one (redis-server) or point "
                                 "--redis-url (or REDIS_URL) at yours", param_hint="--redis-url") from None


@with_settings(model=DataPackOptions, param="given", section=SECTION)
def bench_data_pack(given: dict) -> None:
    """Tokenization throughput (tokens/s, 1 thread and every core) and the time to pack a folder of real text
    with --data (cold, then a cache hit), written to OUT (benchmarks.data_pack)."""
    from benchmarks.data_pack import run

    o = parse(DataPackOptions, given)
    res = run(o.size_mb, o.model, o.workdir, o.out)
    tp, cold = res["tokenize_throughput"], res["pack_cold"]
    for k, v in tp.items():
        if k.startswith("threads_"):
            typer.echo(f"tokenize {k.replace('_', ' ')}: {v['tokens_per_s']:,} tokens/s ({v['tokens']:,} tokens)")
    typer.echo(f"pack {res['folder']['bytes'] / 1e6:.1f} MB in {res['folder']['files']} files: {cold['total_s']:.1f} s "
               f"cold ({cold['tokens']:,} tokens; tokenize {cold['tokenize_s']:.1f} s), "
               f"{res['pack_warm_cache_hit']['total_s']:.1f} s cache hit; load {res['machine']['load_avg_1m_before']} "
               f"-> {res['machine']['load_avg_1m_after']} on {res['machine']['cpus']} CPUs; wrote {o.out}")


@with_settings(model=PrecisionOptions, param="given", section=SECTION)
def bench_precision(given: dict) -> None:
    """Per round kind, the signal-to-noise of TF32 and bf16 forwards against fp32 (benchmarks.precision)."""
    from benchmarks.precision import measure, precisions, table

    o = parse(PrecisionOptions, given)
    res = measure(o, progress=lambda m: typer.echo(m, err=True))
    res["measured_precision"] = precisions(res)
    if o.json_out is not None:
        o.json_out.write_text(json.dumps(res, indent=1))
    typer.echo(table(res))
    typer.echo(f"bound: bf16 SNR >= {res['snr_bound']:g}; from this measurement: {res['measured_precision']}")


@with_settings(model=SegmentsBench, param="given", section=SECTION)
def bench_segments(given: dict) -> None:
    """A worker's forward whole vs segmented (one block's kernels queued at a time, beside an engine): forwards/s
    with the engine idle and the time from a cut to the device idle (benchmarks.segments)."""
    from benchmarks.segments import measure, table

    o = SegmentsBench(**given)
    res = measure(o, progress=lambda m: typer.echo(m, err=True))
    if o.json_out is not None:
        o.json_out.parent.mkdir(parents=True, exist_ok=True)
        o.json_out.write_text(json.dumps(res, indent=1))
    typer.echo(table(res))


@with_settings(model=ServingBench, param="given", section="The measurement (benchmarks.serving_options.ServingBench)")
def bench_serving(given: dict) -> None:
    """Serving latency beside a fleet worker: (a) engine alone, (b) busy worker, (c) engine-aware yielding[, (d) (c)
    at a lower CPU priority]."""
    from benchmarks.serving import run_serving_bench

    cfg = parse(ServingBench, given)
    if cfg.pinned and len(os.sched_getaffinity(0)) < 2:
        raise typer.BadParameter("needs 2 CPUs (the engine and worker on one, trainer and load on the other)")
    _redis_answers(cfg.redis_url)
    res = run_serving_bench(cfg, progress=lambda m: typer.echo(m, err=True))
    nan = float("nan")
    for arm, f in res["arms"].items():
        typer.echo(f"({arm}) TTFT p50/p95/p99 {f['ttft_s']['p50']:.3f}/{f['ttft_s']['p95']:.3f}/"
                   f"{f['ttft_s']['p99']:.3f} s  e2e {f['e2e_s']['p50']:.3f}/{f['e2e_s']['p95']:.3f}/"
                   f"{f['e2e_s']['p99']:.3f} s  {f['output_tokens_per_s']:.2f} tokens/s  forwards "
                   f"{f['probe_forwards_done']:.0f}  idle used {f['idle_used_share'] or 0:.2f}  reclaim p95 "
                   f"{f['reclaim_s']['p95'] or nan:.3f} s (detect {f['reclaim_detect_s']['p95'] or nan:.3f}, cut "
                   f"{f['reclaim_cut_s']['p95'] or nan:.3f}; then hand-back {f['hand_back_s']['p95'] or nan:.3f})  drained workers' tasks {f['drained_workers_task_s']:.1f} s  "
                   f"load {[round(x, 1) for x in f['load_avg_1min']]}"
                   + (f"  FAILED {f['errors']} of {f['requests']} requests (left out of the figures; serving.json"
                      " has each error)" if f["errors"] else ""))
    for arm, r in res["paired"].items():  # the same requests in every arm; 90% block-bootstrap intervals
        typer.echo(f"({arm}) / (a) p95: " + ", ".join(
            f"{name} {r[k]['p95_ratio']:.3f}x [{r[k]['p95_ratio_90ci'][0]:.2f}, {r[k]['p95_ratio_90ci'][1]:.2f}] "
            f"(median request {r[k]['median_request_ratio']:.3f}x)" for name, k in (("TTFT", "ttft_s"), ("e2e", "e2e_s"))))
    typer.echo(f"wrote {cfg.out / 'serving.json'} and {cfg.out / 'serving.png'}")


@with_settings(model=ServingLoad, param="given", section=SECTION)
def bench_serving_load(
    url: Annotated[str, typer.Argument(help="The engine's base URL (OpenAI-compatible), e.g. http://127.0.0.1:8100")],
    given: dict,
) -> None:
    """The open-loop request load alone (Poisson arrivals, lengths from a real text) against a running engine (what
    `up --serving vllm` sends, sparecycles.up_serving). Prints TTFT and end-to-end p50/p95/p99."""
    import httpx

    from benchmarks.serving_load import CONTEXT, make_requests, outcome_dict, percentiles, run_load, verses

    o = parse(ServingLoad, given)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    outs = run_load(url, model, make_requests(o.requests, o.rate, o.seed, verses(o.requests * CONTEXT + 1)))
    ok = [o for o in outs if not o.error and o.end is not None]
    ttft = percentiles([o.ttft_s for o in ok if o.ttft_s is not None])
    e2e = percentiles([o.e2e_s for o in ok])
    if o.json_out is not None:
        o.json_out.write_text(json.dumps({"ttft_s": ttft, "e2e_s": e2e, "requests": [outcome_dict(o) for o in outs]},
                                        indent=1))
    typer.echo(f"{len(ok)}/{len(outs)} answered; TTFT p50/p95/p99 {ttft}; end to end {e2e}")


# short_help: the one-line summaries `sparecycles bench --help` lists, whole at 80 columns.
bench_app.command("kernels", cls=SettingsCommand, short_help="Fused perturb/replay kernels vs copy bandwidth.")(
    bench_kernels)
bench_app.command("probe", cls=SettingsCommand, short_help="One probe worker's speed on one GPU.")(bench_probe)
bench_app.command("intake", cls=SettingsCommand, short_help="Coordinator intake: results/s and latency.")(bench_intake)
bench_app.command("fleet", cls=SettingsCommand, short_help="Fleet probes/s with 1, 2, 4 workers; publish time.")(bench_fleet)
bench_app.command("churn", cls=SettingsCommand, short_help="A trainer on a fleet whose workers come and go.")(bench_churn)
bench_app.command("shares", cls=SettingsCommand, short_help="Two runs sharing a fleet at stated shares.")(bench_shares)
bench_app.command("data-pack", cls=SettingsCommand, short_help="Tokens/s and the time to pack a 100 MB --data folder.")(
    bench_data_pack)
bench_app.command("precision", cls=SettingsCommand, short_help="bf16 vs TF32 signal-to-noise per round kind.")(bench_precision)
bench_app.command("segments", cls=SettingsCommand, short_help="A worker's forward whole vs segmented beside an engine.")(
    bench_segments)
bench_app.command("serving", cls=SettingsCommand, short_help="Serving latency beside a worker, with and without yielding.")(
    bench_serving)
bench_app.command("serving-load", cls=SettingsCommand, short_help="Open-loop requests against a running engine.")(bench_serving_load)

if __name__ == "__main__":
    bench_app()
