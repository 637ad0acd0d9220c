"""`sparecycles bench intake` (imports only typer and the standard library at module top)."""

from __future__ import annotations

import json
import os

import typer


def bench_intake(
    workers: int = typer.Option(64, min=1, help="Simulated workers (concurrent connections/threads)."),
    results: int = typer.Option(50_000, min=1, help="Probe results to submit in total."),
    batch: int = typer.Option(4, min=1, max=1024, help="Results per request (a task's seeds)."),
    mode: str = typer.Option("both", help="http, store or both."),
    rate: float = typer.Option(
        0.0, min=0.0, help="Open-loop offered load in results/s (http); 0 = closed loop."
    ),
    redis_url: str = typer.Option(
        os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), help="Redis to use (keys are namespaced)."
    ),
    coordinators: int = typer.Option(
        1, min=1, max=64, help="Coordinator processes in http mode (sparecycles coordinator --workers)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per mode."),
) -> None:
    """Results accepted per second end to end through Redis, and p50/p99 latency from publish to acceptance."""
    from coordinator.bench import result_dict, run_intake_bench

    if mode not in ("http", "store", "both"):
        raise typer.BadParameter("mode must be http, store or both")
    for m in ["http", "store"] if mode == "both" else [mode]:
        res = run_intake_bench(m, workers, results, batch, redis_url, rate, coordinators=coordinators)
        if json_out:
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
