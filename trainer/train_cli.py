"""`sparecycles train`: the command, built by `train_command(hooks)`.

Its options are generated: the training settings from TrainConfig and how the run runs from RunOptions
(trainer.run_options), both through trainer.cli_settings, and its own (--preset, --coordinator, read from the
environment too, and two hidden ones) from TrainCommandOptions. The fleet (fleet.attach, fleet.teacher) sits
above the trainer, so the top layer hands it in as `FleetHooks` (sparecycles.cli); nothing is set at module level.
Only light modules are imported until every option is checked: an option error never waits for torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, ConfigDict, Field

from trainer import launch
from trainer.cli import _refuse_or_reuse, _report, _run_train, _serve_metrics, _setup_dist
from trainer.cli_settings import build, with_settings
from trainer.run_options import NOT_OPTIONS, RunOptions

RUN_SECTION = "How the run runs (RunOptions; `up` takes the same names)"


@dataclass(frozen=True)
class FleetHooks:
    """What the top layer (sparecycles.cli) hands `train` for a fleet.

    attach(url, wait_s=, log=, rounds=, settings=, share=) -> fleet.attach.Fleet, raising FleetError (a RuntimeError);
    settings() -> fleet.attach.FleetSettings from the environment, raising FleetError naming each variable;
    teacher_rounds(url, window=, strict=, run=, coordinator=) -> trainer.train's kd_loss_factory (fleet.teacher),
    raising ValueError when its Redis does not answer; `coordinator` (URL, admin token) registers the rounds there
    (and ends them there when the run ends: the loss's close, trainer.train).
    """

    attach: Callable[..., Any]
    settings: Callable[[], Any]
    teacher_rounds: Callable[..., Any]


class TrainCommandOptions(BaseModel):
    """`train`'s own options, neither a training setting (TrainConfig) nor how the run runs (RunOptions): where its
    defaults and its fleet come from, and two hidden ones. Each field is one generated option (trainer.cli_settings);
    the coordinator's URL is checked with the fleet's environment (trainer.preflight.check_coordinator_url)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str = Field("demo", min_length=1, description="Run preset (demo) or model preset (gpt2-tiny, gpt2-small, "
                        "...): the defaults that the training settings below override")
    coordinator: str | None = Field(None, description="Get the probes (and by default the evaluation) "
                                    "from this coordinator's fleet; needs SPARECYCLES_ADMIN_TOKEN and "
                                    "SPARECYCLES_REDIS_URL in the environment. Default: all in process",
                                    json_schema_extra={"envvar": "SPARECYCLES_COORDINATOR_URL"})
    fleet_sync: bool = Field(False, description="Same as --fleet-wait sync (kept for old commands)",
                             json_schema_extra={"hidden": True})
    config: Path | None = Field(None, description="A whole TrainConfig as JSON (what `up --nproc-per-node` hands its "
                                "ranks): replaces --preset and the run's settings", json_schema_extra={"hidden": True})


def train_command(hooks: FleetHooks) -> Callable[..., None]:
    """The `train` typer command over `hooks` (register it with cls=trainer.cli_settings.SettingsCommand)."""

    @with_settings(model=RunOptions, param="run", exclude=NOT_OPTIONS, section=RUN_SECTION)
    @with_settings()
    @with_settings(model=TrainCommandOptions, param="own", section="Options")
    def train(settings: dict, run: dict, own: dict) -> None:
        """Train a model and write a run folder (metrics.jsonl, TensorBoard event files, checkpoint.safetensors,
        loss.png, summary.json, export/).

        Every option is checked before training. A folder holding this run finished (same settings) is reused
        and its summary printed; one holding another run is refused (naming the differences) unless
        --overwrite; an interrupted one continues with --resume. Under torchrun (or with --nproc-per-node) every
        rank runs this command; rank 0 alone writes the run folder and talks to the coordinator.
        """
        o = build(TrainCommandOptions, own)
        opts = run_options(run, coordinator=o.coordinator, fleet_sync=o.fleet_sync)
        cfg = _resolve_checked(o.preset, settings, opts, o.coordinator, o.config)
        resumed = cfg if o.config else _as_resumed(cfg, o.preset, settings)
        _train(resumed if opts.resume else cfg, opts, o.coordinator, hooks, resumed=resumed)

    return train


def run_options(given: dict[str, Any], *, coordinator: str | None, fleet_sync: bool = False) -> RunOptions:
    """`train`'s RunOptions from its generated options' values; raises typer.BadParameter (exit 2) with the
    validators' message for a refused option or combination."""
    from pydantic import ValidationError

    from trainer.preflight import explain

    values = {**given, "fleet": bool(coordinator)}
    if fleet_sync:
        values["fleet_wait"] = "sync"
    try:
        return RunOptions(**values)
    except ValidationError as exc:
        raise typer.BadParameter(explain(exc)) from None


def _as_resumed(cfg: Any, preset: str, overrides: dict[str, Any]) -> Any:
    """`cfg` as a --resume of the run in its folder trains it: a --warmup-steps the user did not set is the one the
    folder's config.json records (trainer.config.resolve_preset's `recorded_warmup`), not the one derived from this
    --steps, so lengthening a run whose warmup was derived is the same run. `cfg` itself when the folder records
    none or the recorded warmup does not fit this --steps (the resume is then refused naming both values)."""
    import json

    from trainer.config import resolve_preset
    from trainer.run_dir import default_run_dir

    try:
        recorded = json.loads(((cfg.run_dir or default_run_dir(cfg)) / "config.json").read_text()).get("warmup_steps")
    except (OSError, ValueError, AttributeError):  # no folder yet, or not a run's config.json
        return cfg
    if not isinstance(recorded, int) or recorded == cfg.warmup_steps:
        return cfg
    try:
        return resolve_preset(preset, overrides, recorded_warmup=recorded)
    except ValueError:  # e.g. the recorded warmup reaches past a shortened --steps
        return cfg


def _train(cfg: Any, opts: RunOptions, coordinator: str | None, hooks: FleetHooks, resumed: Any = None) -> None:
    """`train` once every option is checked: torchrun, the folder, the fleet, the run, the report. `resumed`: `cfg`
    as --resume would train it (`_as_resumed`), for the refusal of another --steps without --resume (it names
    --resume when that resume would be accepted). A --resume of this run, finished with this --steps, changes
    nothing: one line, exit 0 (it used to rewrite summary.json)."""
    from trainer.preflight import folder_state, no_probe_round_warning
    from trainer.run_dir import default_run_dir

    if opts.kd_cache is not None and cfg.teacher is None:
        raise typer.BadParameter("--kd-cache needs --teacher", param_hint="--kd-cache")
    fleet_settings = _fleet_settings(hooks) if coordinator else None
    if opts.nproc_per_node is not None and not launch.launched_by_torchrun():
        launch.check_launch(cfg, opts.shard, opts.nproc_per_node, opts.micro_batch_size)  # before torchrun starts
        raise typer.Exit(launch.relaunch(opts.nproc_per_node, cfg.device))
    dist = _setup_dist(cfg, shard=opts.shard, micro_batch_size=opts.micro_batch_size, fleet=bool(coordinator),
                       timeout_s=opts.dist_timeout, rounds=opts.rounds())
    folder = cfg.run_dir or default_run_dir(cfg)
    fleet_wait = (opts.fleet_wait or "never") if coordinator else None  # None: probes in process
    state = folder_state(folder, cfg, fleet_wait)
    if not opts.resume and not opts.overwrite and state.kind in ("done", "other"):
        extend = folder_state(folder, resumed or cfg, fleet_wait).diffs if state.kind == "other" else ()
        return _refuse_or_reuse(folder, state, dist.is_main, resumable=all(d.startswith("steps: ") for d in extend))
    if opts.resume and state.kind == "done":  # its summary is this run's final one: nothing to train or rewrite
        if dist.is_main:
            typer.echo(f"{folder} already holds this run, finished at --steps {cfg.steps}: nothing to resume, "
                       "nothing changed (a larger --steps extends it)", err=True)
        return None
    warning = no_probe_round_warning(cfg, fleet_wait)
    if warning and dist.is_main:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    if dist.is_main:  # rank 0 alone reports (one port per host)
        _serve_metrics(opts.metrics_port, opts.metrics_host, bool(coordinator))
    fleet_kw = _attach_ranks(dist, coordinator, cfg, opts, fleet_settings, hooks) if coordinator else {}
    if opts.teacher_rounds:
        at = (coordinator, fleet_settings.admin_token.get_secret_value()) if coordinator else None
        fleet_kw["kd_loss_factory"] = _teacher_rounds(cfg, opts, hooks, at)
    if opts.kd_cache is not None:
        fleet_kw["kd_loss_factory"] = _kd_cache(cfg, opts.kd_cache, dist)
    result = _run_train(cfg, dist, folder, resume=opts.resume, progress=opts.progress, overwrite=opts.overwrite,
                        export=opts.export, fleet_kw=fleet_kw)
    if dist.is_main:
        _report(result, warning, opts.require_fleet)


def _resolve_checked(preset: str, overrides: dict[str, Any], opts: RunOptions, coordinator: str | None,
                     config: Path | None = None) -> Any:
    """The run's TrainConfig (trainer.config.resolve_preset, or read whole from `config`, a JSON file) with every
    option checked: raises typer.BadParameter (naming the option) for an invalid one, or a method that cannot use
    the fleet it is given."""
    from trainer.config import TrainConfig, resolve_preset
    from trainer.preflight import check_options, explain, input_warning

    try:
        cfg = TrainConfig.model_validate_json(config.read_text()) if config else resolve_preset(preset, overrides)
    except OSError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    except ValueError as exc:  # pydantic's ValidationError, or an unknown preset
        hint = "--config" if config else None if hasattr(exc, "errors") else "--preset"
        raise typer.BadParameter(explain(exc), param_hint=hint) from exc
    try:
        check_options(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if (skipped := input_warning(cfg)) is not None:
        typer.secho(f"warning: {skipped}", fg=typer.colors.YELLOW, err=True)
    if coordinator:
        from trainer.preflight import check_coordinator_url

        try:
            check_coordinator_url(coordinator)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        _fleet_use(cfg, opts)
    return cfg


def _fleet_use(cfg: Any, opts: RunOptions) -> tuple[bool, bool]:
    """(probes, evaluation) a run attached to a fleet sends there; raises typer.BadParameter when it sends neither
    (a first-order optimizer with --eval-on trainer). Torch-free: checked before anything heavy is imported."""
    from trainer.methods import fleet_method_names

    allowed = fleet_method_names(cfg.task)
    probes, evaluate = cfg.optimizer in allowed, opts.eval_on in ("fleet", "auto")
    if not probes and not evaluate:
        raise typer.BadParameter(f"--optimizer {cfg.optimizer} (the preset's, if you gave none) sends no probes to "
                                 f"a fleet and --eval-on trainer keeps the evaluation here; --coordinator needs one "
                                 f"of {', '.join(allowed)} or --eval-on fleet", param_hint="--coordinator")
    return probes, evaluate


def _fleet_settings(hooks: FleetHooks) -> Any:
    """The fleet's settings from the environment, read with the option checks: a missing or refused
    SPARECYCLES_ADMIN_TOKEN / SPARECYCLES_REDIS_URL / SPARECYCLES_KEY_PREFIX exits 2 naming it, before anything
    heavy is imported or started (the metrics server, torchrun)."""
    try:
        return hooks.settings()
    except RuntimeError as exc:  # fleet.attach.FleetError
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _attach_fleet(url: str, cfg: Any, opts: RunOptions, settings: Any, hooks: FleetHooks) -> dict[str, Any]:
    """`train`'s keyword arguments for a run attached to a fleet (mode_factory when its probes go there,
    evaluator_factory when its evaluation does, status); exits 2 with a clear message for a run that would send
    the fleet nothing, an unreachable coordinator, a refused token or no active worker in time."""
    probes, evaluate = _fleet_use(cfg, opts)
    try:
        fleet = hooks.attach(url, wait_s=opts.attach_wait, rounds=opts.rounds(), share=opts.share,
                             log=lambda m: typer.echo(m, err=True), settings=settings)
    except (RuntimeError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    doing = [*(["probes"] if probes else []), *(["evaluation"] if evaluate else [])]
    typer.echo(f"{' and '.join(doing)} on the fleet at {fleet.base}: {fleet.workers} active worker(s)", err=True)
    out: dict[str, Any] = {"status": fleet.status}
    if probes:
        out["mode_factory"] = fleet.mode_factory
    if evaluate:
        out["evaluator_factory"] = fleet.evaluator_factory(deadline_s=opts.eval_deadline,
                                                           full=opts.eval_windows == "full")
    return out


def _attach_ranks(dist: Any, coordinator: str, cfg: Any, opts: RunOptions, fleet_settings: Any,
                  hooks: FleetHooks) -> dict[str, Any]:
    """Rank 0 attaches to the fleet (`_attach_fleet`); the other ranks learn whether it did and exit 2 quietly when
    it did not. Returns rank 0's `train` keyword arguments ({} on the others)."""
    fleet_kw: dict[str, Any] = {}
    attached = False
    try:
        if dist.is_main:
            fleet_kw = _attach_fleet(coordinator, cfg, opts, fleet_settings, hooks)
        attached = True
    finally:  # rank 0's own error propagates; the others exit 2 quietly
        if dist.parallel and not dist.broadcast_object(attached) and not dist.is_main:
            raise typer.Exit(2)
    return fleet_kw


def _teacher_rounds(cfg: Any, opts: RunOptions, hooks: FleetHooks, coordinator: tuple[str, str] | None) -> Any:
    """train's kd_loss_factory for --teacher-rounds; exits 2 without --teacher, with --kd-estimator full or a Redis
    that does not answer. `coordinator` (URL, admin token), with --coordinator: the rounds are registered there,
    so its enrolled workers answer them (no --teacher-queue on the workers)."""
    if cfg.teacher is None or cfg.kd_estimator == "full":
        raise typer.BadParameter("--teacher-rounds needs --teacher and --kd-estimator sampled or topk (got teacher "
                                 f"{cfg.teacher!r}, {cfg.kd_estimator})", param_hint="--teacher-rounds")
    try:
        return hooks.teacher_rounds(opts.teacher_rounds, window=opts.kd_window, strict=opts.kd_strict,
                                    run=opts.teacher_queue, coordinator=coordinator)
    except ValueError as exc:  # fleet.teacher.kd_loss_factory: the Redis does not answer
        typer.secho(f"error: --teacher-rounds: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _kd_cache(cfg: Any, root: Path, dist: Any) -> Any:
    """train's kd_loss_factory for --kd-cache (trainer.kd.cache); the cache's plan is checked here, before the
    run folder is opened: another plan, a cache holding none, a bad teacher, or a torchrun job (`kd fill` plans the
    whole batch of one process; a rank trains on its rows of it) exits 2 with one line."""
    from trainer.kd.cache import kd_cache_factory, open_for_run, plan_for
    from trainer.tasks import build_task

    try:
        if dist.parallel:
            raise ValueError(f"--kd-cache under torchrun ({dist.world} ranks): `kd fill` plans the whole batch "
                             "of one process and each rank trains on its rows of it; use --teacher-rounds, or one "
                             "process")
        open_for_run(root, plan_for(cfg, build_task(cfg), rank=dist.rank))
    except ValueError as exc:  # CachePlanError, TeacherMismatchError, a --data build refused
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    return kd_cache_factory(root)
