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
from sparecycles.fleet_cli import fleet as fleet_command
from sparecycles.kd_cli import kd_app
from sparecycles.up_plan import NOT_SETTABLE
from trainer import cli as trainer_cli
from trainer import export_cli
from trainer.cli_settings import SettingsCommand, with_settings
from trainer.console import stops_cleanly
from trainer.methods import fleet_method_names


def _fleet_methods(task: str) -> list[str]:
    """The methods `up` can probe over a fleet on `task`, its default excluded (for --help)."""
    default = "1.5spsa" if task == "sentiment" else "zocurv-line"
    return [name for name in fleet_method_names(task) if name != default]

app = typer.Typer(
    name="sparecycles",
    help="Train language models with the forward-only compute idle inference GPUs leave: "
    "zeroth-order probes for curvature (ZO-Curv) and memory-light ZO training (1SPSA, 1.5-SPSA, MeZO).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # Plain click help: rich's option tables wrap every help text into a narrow column at 80 columns.
    rich_markup_mode=None,
)


def _attach(url: str, **kw):
    from sparecycles.loop import connect  # the public API's connect: one code path for the CLI and any loop

    return connect(url, run_prefix="train", **kw)


def _fleet_settings():
    from fleet.attach import load_settings

    return load_settings()


def _teacher_rounds(url: str, **kw):
    from fleet.teacher import kd_loss_factory

    return kd_loss_factory(url, **kw)


trainer_cli.FLEET_ATTACH = _attach  # `train --coordinator`: the top layer hands the trainer its fleet
trainer_cli.TEACHER_ROUNDS = _teacher_rounds  # `train --teacher-rounds`: teacher targets from the fleet
trainer_cli.FLEET_SETTINGS = _fleet_settings  # ... and the check of its environment, made with the option checks
app.add_typer(trainer_cli.data_app, name="data")
app.add_typer(kd_app, name="kd")  # `kd fill`: teacher targets ahead of time (fleet.kd_fill)
app.command("train", cls=SettingsCommand, short_help="Train one model in this process; write its run folder.")(
    stops_cleanly(trainer_cli.train))
app.command("export", short_help="Export a finished run's model as a transformers folder.")(
    export_cli.export)
app.add_typer(bench_app, name="bench")
app.command("coordinator")(api_cli.coordinator)
app.command("worker", short_help="Join a coordinator and evaluate its probe tasks.")(worker_cli.worker)
app.command("fleet", short_help="A fleet on this machine for your own loop, up until stopped.")(fleet_command)


@app.command("up", cls=SettingsCommand, short_help="Everything on this machine: AdamW vs a fleet-probed run.")
@stops_cleanly  # SIGINT/SIGTERM from the first instruction: `kill`/`timeout` get Ctrl-C's clean shutdown of every child
@with_settings(exclude=NOT_SETTABLE)
def up(
    settings: dict,
    preset: str = typer.Option("demo", help="Run preset (demo; with --task sentiment: sentiment-demo) or a "
                               "model preset: the defaults that the training settings below override."),
    task: str = typer.Option("lm", help="lm (pretraining, ZO-Curv) or sentiment (MiniLM-L6, pure ZO)."),
    optimizer: str | None = typer.Option(None, help="The fleet-probed optimizer (AdamW always runs as the "
                                         f"baseline). lm: zocurv-line (default), {', '.join(_fleet_methods('lm'))}; "
                                         f"sentiment: 1.5spsa (default), {', '.join(_fleet_methods('sentiment'))}."),
    workers: int = typer.Option(2, min=1, max=64, help="Local probe worker processes."),
    run_dir: Path | None = typer.Option(None, help="Run folder. Default: runs/up-<preset>-<optimizer>, plus "
                                        "the settings that differ from the preset's (e.g. -steps5)."),
    overwrite: bool = typer.Option(False, help="Replace a run folder that holds a run with other settings."),
    keep_blobs: bool = typer.Option(False, help="Keep the coordinator's weight blobs and Valkey files."),
    progress: bool = typer.Option(True, help="Show the live progress display."),
    export: bool = typer.Option(True, help="Export each finished model as a transformers folder RUN_DIR/<run>/export."),
    device: str | None = typer.Option(None, help="The trainer's device (both runs): cpu (default) or cuda:N."),
    worker_devices: str | None = typer.Option(None, help="One probe worker per listed device, e.g. cuda:1,cuda:2 "
                                              "(replaces --workers)."),
    gpus: str | None = typer.Option(None, help="auto: the trainer on the first GPU, a probe worker on each other "
                                    "(one GPU: both share it)."),
    eval_on: str = typer.Option("auto", help="Where both runs' held-out evaluation runs: trainer, fleet, or auto "
                                "(= fleet: the trainer publishes the version and moves on)."),
    eval_windows: str = typer.Option("subset", help="Evaluation on the fleet: subset (the runs' eval_batches windows, "
                                     "as the trainer evaluates) or full (the whole validation split)."),
    eval_deadline: float = typer.Option(120.0, min=0.0, help="Seconds without a result before the trainer "
                                        "evaluates a version itself."),
    fleet_wait: str = typer.Option("interval", help="When the ZO run waits for its probe rounds: interval (each "
                                   "round folds at the refresh after it, waiting only when the fleet is a whole "
                                   "interval behind: an interrupted run resumes bit for bit), sync, or never (a "
                                   "late round is skipped and counted)."),
    nproc_per_node: int | None = typer.Option(
        None, min=1, help="Train each run under torchrun with N processes (DDP, the global batch split over the "
        "ranks; rank 0 talks to the coordinator), as `train --nproc-per-node`: one rank per GPU with a CUDA "
        "trainer (cuda:0..N-1), gloo on the CPU; with N > 1 evaluation runs on the ranks. Default: in this process."),
    set_: list[str] | None = typer.Option(None, "--set", help="KEY=VALUE: a training setting of both runs, by the "
                                          "name of its option below, e.g. --set lr=6e-4 --set warmup_steps=40 "
                                          "--set corpus=classics. Repeatable."),
    optimizer_option: list[str] | None = typer.Option(
        None, metavar="KEY=VALUE", help="KEY=VALUE: a knob of the fleet-probed run's optimizer (repeatable), e.g. "
        "start=one for zocurv-trust, s_max=8 for zocurv-line; the folder name gets -KEY-VALUE."),
) -> None:
    """Run everything on this machine: Valkey, coordinator, probe workers, trainer.

    Trains an AdamW baseline and the fleet-probed run at equal steps; writes curves (PNG) and summary.json
    to the run folder. Every option is checked before anything starts. A finished run with the same
    settings is reused, an interrupted one resumed; a folder holding other settings is refused without
    --overwrite. Ctrl-C stops every process it started. Defaults: settings left unset take the preset's
    values (demo: 150 steps, batch 16 x 64 tokens, curvature every 15 steps).
    """
    from fleet.devices import place_here
    from sparecycles.up import plan_up, run_up, stopped_note
    from trainer.cli_settings import key_values

    plan = None
    try:
        placement = place_here(device=device, worker_devices=worker_devices, gpus=gpus, workers=workers)
        if placement.note:
            typer.echo(placement.note, err=True)
        plan = plan_up(preset=preset, optimizer=optimizer, workers=len(placement.workers), settings=settings,
                       run_dir=run_dir, task=task, overwrite=overwrite,
                       device=None if placement.trainer == "cpu" else placement.trainer,
                       worker_devices=placement.workers, train_options=tuple(set_ or ()), eval_on=eval_on,
                       eval_windows=eval_windows, fleet_wait=fleet_wait, eval_deadline=eval_deadline,
                       nproc_per_node=nproc_per_node, optimizer_options=key_values(optimizer_option or []))
        summary = run_up(plan, progress=progress, keep_blobs=keep_blobs, export=export,
                         log=lambda m: typer.secho(m, fg=typer.colors.YELLOW if m.startswith("warning") else None,
                                                   err=True))
    except (ValueError, RuntimeError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        typer.echo(f"interrupted: every process stopped; {stopped_note(plan)}", err=True)
        raise typer.Exit(130) from None
    typer.echo(json.dumps(summary, indent=2))
    from trainer.ledger import format_ledger

    for name in ("adamw", summary["optimizer"]):
        if "time_ledger" in summary.get(name, {}):
            typer.echo("\n".join(format_ledger(summary[name]["time_ledger"], f"{name} time ledger")), err=True)
    disk = summary["disk_mb"]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in disk.items() if k != "total" and v >= 0.1)
    typer.echo(f"{plan.out}: {disk['total']:.1f} MB on disk ({parts}); wall {summary['wall_s']:.0f} s", err=True)


@app.command("version")
def version() -> None:
    """Print the installed version."""
    from sparecycles import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    from trainer.launch import launched_by_torchrun, run_rank  # torch-free: option errors still come first

    if launched_by_torchrun():  # a rank of `train`/`up --nproc-per-node` (trainer.launch.launch_torchrun)
        run_rank(app)
    app()
