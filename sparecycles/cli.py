"""The `sparecycles` console script.

Each subcommand lives in the `cli` module of the package that owns it; those modules import only typer
(and the standard library) at import time, so `sparecycles coordinator --help` never imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from api import cli as api_cli
from benchmarks.cli import bench_app
from probe_worker import cli as worker_cli
from trainer import cli as trainer_cli
from trainer import export_cli

app = typer.Typer(
    name="sparecycles",
    help="Train language models with the forward-only compute idle inference GPUs leave: "
    "zeroth-order probes for curvature (ZO-Curv) and memory-light ZO training (1SPSA, 1.5-SPSA, MeZO).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(trainer_cli.data_app, name="data")
app.command("train")(trainer_cli.train)
app.command("export")(export_cli.export)
app.add_typer(bench_app, name="bench")
app.command("coordinator")(api_cli.coordinator)
app.command("worker")(worker_cli.worker)


@app.command("up")
def up(
    preset: str = typer.Option("demo", help="Run preset (demo; with --task sentiment: sentiment-demo) or model "
                               "preset."),
    task: str = typer.Option("lm", help="lm (pretraining, ZO-Curv) or sentiment (MiniLM-L6, pure ZO)."),
    optimizer: str | None = typer.Option(None, help="The fleet-probed optimizer. Default: zocurv-line for lm (the "
                                         "ZO-Curv variant the side-by-side benchmark supports, benchmarks/results/zo); "
                                         "1.5spsa for sentiment (mezo, 1spsa or 1.5spsa)."),
    workers: int = typer.Option(2, min=1, max=64, help="Local probe worker processes."),
    steps: int | None = typer.Option(None, min=1, help="Optimizer steps (default: the preset's)."),
    probes: int | None = typer.Option(None, min=1, help="ZO probes K per step / curvature round (default: the "
                                      "preset's)."),
    batch_size: int | None = typer.Option(None, min=1, help="Sequences (sentences) per step (default: the "
                                          "preset's)."),
    seq_len: int | None = typer.Option(None, min=2, help="Tokens per sequence (sentence) (default: the preset's)."),
    curvature_interval: int | None = typer.Option(None, min=1, help="Steps between curvature rounds."),
    run_dir: Path | None = typer.Option(None, help="Run folder (default runs/up-<preset>-<optimizer>)."),
    progress: bool = typer.Option(True, help="Show the live progress display."),
    export: bool = typer.Option(True, help="Export each finished model as a transformers folder RUN_DIR/<run>/export."),
) -> None:
    """Run everything on this machine: embedded Valkey (unless REDIS_URL), coordinator, N probe workers
    and the trainer; AdamW baseline vs the fleet-probed run at equal steps; curves PNG and a JSON summary.
    Ctrl-C stops every process it started."""
    import signal

    from sparecycles.up import run_up

    def _terminate(signum, frame):  # `kill`/`timeout` get Ctrl-C's clean shutdown of every child
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = run_up(preset=preset, optimizer=optimizer, workers=workers, steps=steps, run_dir=run_dir,
                         curvature_interval=curvature_interval, progress=progress, task=task, probes=probes,
                         batch_size=batch_size, seq_len=seq_len, export=export)
    except (ValueError, RuntimeError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        typer.echo("interrupted: every process stopped; rerun the same command to resume", err=True)
        raise typer.Exit(130)
    typer.echo(json.dumps(summary, indent=2))


@app.command("version")
def version() -> None:
    """Print the installed version."""
    from sparecycles import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
