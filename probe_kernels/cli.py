"""`sparecycles bench kernels`: typer command (imports only typer + stdlib at module top)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)


@bench_app.command("kernels")
def bench_kernels(
    preset: Annotated[str, typer.Option(help="comma-separated presets: gpt2-small, gpt2-medium, gpt2-large")] = (
        "gpt2-small,gpt2-large"
    ),
    dist: Annotated[str, typer.Option(help="probe distribution: gauss8 or rademacher")] = "gauss8",
    k: Annotated[int, typer.Option(min=1, help="seeds per replay")] = 40,
    batch: Annotated[int, typer.Option(min=1, help="forward batch size (gpt2-small overhead test)")] = 16,
    seq_len: Annotated[int, typer.Option(min=1, max=1024, help="forward sequence length")] = 1024,
    forward: Annotated[bool, typer.Option(help="also measure per-probe overhead vs a gpt2-small forward")] = True,
    json_out: Annotated[Path | None, typer.Option(help="write all measurements as JSON here")] = None,
) -> None:
    """Effective bandwidth of the fused perturb/replay kernels vs a device copy and naive PyTorch, and the
    per-probe perturbation overhead vs one bf16 forward of gpt2-small. Needs a CUDA GPU."""
    from probe_kernels.bench import render, run_bench

    names = [p.strip() for p in preset.split(",") if p.strip()]
    try:
        res = run_bench(names, dist, k, batch, seq_len, forward)
    except (ValueError, RuntimeError) as e:
        raise typer.BadParameter(str(e)) from e
    render(res)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2))
        typer.echo(f"wrote {json_out}")


def bench_probe(  # registered as `sparecycles bench probe` in benchmarks.cli
    preset: Annotated[str, typer.Option(help="comma-separated presets: gpt2-small, gpt2-medium, gpt2-large")] = (
        "gpt2-small,gpt2-large"
    ),
    batch: Annotated[int, typer.Option(min=1, help="probe batch size")] = 16,
    seq_len: Annotated[int, typer.Option(min=1, max=1024, help="probe sequence length")] = 1024,
    parity_seeds: Annotated[int, typer.Option(min=1, help="seeds compared with the reference path (the "
                                              "first preset; a tenth of them for the others)")] = 100,
    cuda_graphs: Annotated[bool, typer.Option(help="compile in mode reduce-overhead (CUDA graphs)")] = False,
    cross_process: Annotated[bool, typer.Option(help="recompute the first preset's bits in a second process")] = True,
    json_out: Annotated[Path | None, typer.Option(help="write all measurements as JSON here (after each preset)")] = None,
) -> None:
    """A probe worker's speed on one GPU: the compiled whole-model probe path against the per-unit eager
    reference (probes/s, forward MFU against a measured bf16 matmul, end-to-end probe overhead against a
    clean forward of the same compiled model, parity on seeds, determinism). Needs a CUDA GPU."""
    from probe_kernels.bench_probe import render, run_probe_bench

    names = [p.strip() for p in preset.split(",") if p.strip()]
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
    try:
        res = run_probe_bench(names, batch, seq_len, parity_seeds, cuda_graphs, cross_process, json_out)
    except (ValueError, RuntimeError) as e:
        raise typer.BadParameter(str(e)) from e
    render(res)
    if json_out is not None:
        typer.echo(f"wrote {json_out}")


if __name__ == "__main__":
    bench_app()
