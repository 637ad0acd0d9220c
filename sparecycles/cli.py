"""The `sparecycles` console script.

Each subcommand lives in the `cli` module of the package that owns it; those modules import only typer
(and the standard library) at import time, so `sparecycles coordinator --help` never imports torch.
"""

from __future__ import annotations

import typer

from api import cli as api_cli
from benchmarks.cli import bench_app
from probe_worker import cli as worker_cli
from probe_worker.engine_proxy import ProxyOptions
from sparecycles.cli_errors import OneLineErrors
from sparecycles.fleet_cli import fleet as fleet_command
from sparecycles.kd_cli import kd_app
from sparecycles.up_options import NOT_UP_OPTIONS, UpOptions, UpOverrides
from sparecycles.up_plan import NOT_SETTABLE
from trainer import cli as trainer_cli
from trainer import export_cli
from trainer.cli_settings import SettingsCommand, with_settings
from trainer.console import stop_status, stops_cleanly
from trainer.run_options import RunOptions
from trainer.train_cli import RUN_SECTION, FleetHooks, train_command

app = typer.Typer(
    name="sparecycles",
    cls=OneLineErrors,  # every refusal of an option: one line, exit 2
    help="Train language models with the forward-only compute idle inference GPUs leave: "
    "zeroth-order probes for curvature (ZO-Curv) and memory-light ZO training (1SPSA, 1.5-SPSA, MeZO).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # Plain click help: rich's option tables wrap every help text into a narrow column at 80 columns.
    rich_markup_mode=None,
)


def _attach(url: str, **kw):
    import dataclasses

    from sparecycles.loop import connect  # the public API's connect: one code path for the CLI and any loop

    return dataclasses.replace(connect(url, **kw), run_prefix="train")  # its runs are named train-...


def _fleet_settings():
    from fleet.attach import load_settings

    return load_settings()


def _teacher_rounds(url: str, coordinator: tuple[str, str] | None = None, **kw):
    """fleet.teacher.kd_loss_factory; `coordinator` (base URL, admin token): the run's teacher rounds are
    registered there (fleet.teacher_weights.publish_teacher: the teacher's files as blobs), so the coordinator's
    enrolled workers consume them, as `up --teacher` registers its runs', and ended there when the run ends
    (finished, failed or interrupted), as its probe run is."""
    from fleet.teacher import kd_loss_factory

    if coordinator is None:
        return kd_loss_factory(url, **kw)

    def register(teacher: str, run: str) -> None:
        from coordinator.client import CoordinatorClient
        from fleet.teacher_weights import publish_teacher

        with CoordinatorClient(*coordinator) as client:
            publish_teacher(client, teacher, run)
        typer.echo(f"teacher rounds of run {run} registered at {coordinator[0]}: its workers answer them", err=True)

    def end(run: str) -> None:
        from coordinator.client import CoordinatorClient

        with CoordinatorClient(*coordinator) as client:
            client.end_teacher(run)

    return kd_loss_factory(url, register=register, end=end, **kw)


# `train` gets its fleet from the top layer (trainer may not import fleet, which sits above it): attach for
# --coordinator, the check of the fleet's environment (made with the option checks), teacher rounds.
FLEET_HOOKS = FleetHooks(attach=_attach, settings=_fleet_settings, teacher_rounds=_teacher_rounds)
app.add_typer(trainer_cli.data_app, name="data")
app.add_typer(kd_app, name="kd")  # `kd fill`: teacher targets ahead of time (fleet.kd_fill)
app.command("train", cls=SettingsCommand, short_help="Train one model in this process; write its run folder.")(
    stops_cleanly(train_command(FLEET_HOOKS)))
app.command("export", cls=SettingsCommand, short_help="Export a finished run's model as a transformers folder.")(
    export_cli.export)
app.add_typer(bench_app, name="bench")
app.command("coordinator", cls=SettingsCommand)(
    with_settings(model=api_cli.CoordinatorOptions, param="given", section="Options")(api_cli.coordinator))
app.command("worker", cls=SettingsCommand, short_help="Join a coordinator and evaluate its probe tasks.")(worker_cli.worker)
app.command("fleet", cls=SettingsCommand, short_help="A fleet on this machine for your own loop, up until stopped.")(fleet_command)



@app.command("engine-proxy", cls=SettingsCommand,
             short_help="Serve a load proxy (vLLM's /load) in front of a serving engine whose gauges move late.")
@with_settings(model=ProxyOptions, param="given", section="Options")
def engine_proxy(given: dict) -> None:
    """Forward every request to --upstream (an engine such as llama.cpp's llama-server or SGLang) and answer
    GET /load as vLLM does with --enable-server-load-tracking ({"server_load": N}): N counts a request from its
    arrival at the proxy until its answer has streamed back, so a worker reading it (--serving-metrics URL/load)
    sees a request before the engine's own gauges move (probe_worker.engine_proxy). Runs until SIGINT/SIGTERM."""
    from probe_worker.engine_proxy import serve

    serve(ProxyOptions(**given))  # each value was checked, naming its option, when the command line was parsed

@app.command("up", cls=SettingsCommand, short_help="Everything on this machine: AdamW vs a fleet-probed run.")
@stops_cleanly  # SIGINT/SIGTERM from the first instruction: `kill`/`timeout` get Ctrl-C's clean shutdown of every child
@with_settings(model=UpOptions, param="options", section="Options")
@with_settings(model=RunOptions, param="run", exclude=NOT_UP_OPTIONS, section=RUN_SECTION)
@with_settings(exclude=NOT_SETTABLE)
@with_settings(model=UpOverrides, param="overrides", section="Options")
def up(settings: dict, run: dict, options: dict, overrides: dict) -> None:
    """Run everything on this machine: Valkey, coordinator, probe workers, trainer.

    Trains an AdamW baseline and the fleet-probed run at equal steps; writes curves (PNG) and summary.json
    to the run folder. Every option is checked before anything starts. A finished run with the same
    settings is reused, an interrupted one resumed; a folder holding other settings is refused without
    --overwrite. Ctrl-C stops every process it started. Defaults: settings left unset take the preset's
    values (demo: 150 steps, batch 16 x 64 tokens, curvature every 15 steps).
    """
    from sparecycles.up import run_up, stopped_note
    from trainer.preflight import explain

    plan = None
    try:
        plan = _plan(settings, run, options, overrides)
        summary = run_up(plan, progress=plan_progress(run), keep_blobs=bool(options.get("keep_blobs")),
                         export=run.get("export", True),
                         log=lambda m: typer.secho(m, fg=typer.colors.YELLOW if m.startswith("warning") else None,
                                                   err=True))
    except (ValueError, RuntimeError) as exc:
        typer.secho(f"error: {explain(exc)}", fg=typer.colors.RED, err=True)  # a ValidationError as one line
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        typer.echo(f"interrupted: every process stopped; {stopped_note(plan)}", err=True)
        raise typer.Exit(stop_status()) from None
    _print_summary(plan, summary)


def plan_progress(run: dict) -> bool:
    """`up --progress/--no-progress` (RunOptions.progress, on unless given)."""
    return run.get("progress", RunOptions.model_fields["progress"].default)


def _plan(settings: dict, run: dict, options: dict, overrides: dict):
    """`up`'s UpPlan from its options (sparecycles.up_plan.plan_up), the devices placed first (fleet.devices)."""
    from pydantic import ValidationError

    from fleet.devices import place_here
    from sparecycles.up_plan import plan_up
    from trainer.preflight import explain

    try:
        opts = UpOptions(**options)
    except ValidationError as exc:  # one line naming the option, exit 2
        raise ValueError(explain(exc)) from None
    more = UpOverrides(**overrides)  # each item already checked when parsed (a --set item: by plan_up, naming it)
    placement = place_here(device=opts.device, worker_devices=opts.worker_devices, gpus=opts.gpus,
                           workers=opts.workers)
    if placement.note:
        typer.echo(placement.note, err=True)
    return plan_up(**options, **run, settings=settings, placement=placement, train_options=more.train_options,
                   optimizer_options=dict(more.optimizer_options))


def _print_summary(plan, summary: dict) -> None:
    """`up`'s end: one line per run, serving's line if any, and where summary.json (every figure) is: on stdout
    (sparecycles.up_summary.end_lines). The time ledgers and disk use are in summary.json."""
    from sparecycles.up_summary import end_lines

    typer.echo("\n".join(end_lines(summary, plan.out)))


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
