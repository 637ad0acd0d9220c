"""`sparecycles kd fill`: teacher targets of a planned run, computed ahead of time by teacher workers (issue 36).

Lives in the top layer: it sends through fleet.teacher (trainer may not import fleet). Heavy imports happen inside
the body, after the options are checked.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from trainer.cli_settings import SettingsCommand, with_settings
from trainer.console import stops_cleanly

kd_app = typer.Typer(help="Teacher targets ahead of time (kd fill).",
                     no_args_is_help=True)

_O = typer.Option
RedisUrl = Annotated[str, _O(envvar="SPARECYCLES_REDIS_URL", help="redis:// URL of the teacher workers' broker "
                             "and target store (workers: `sparecycles worker --coordinator URL --token T --teacher-queue "
                             "sparecycles.teacher.RUN`).")]
Cache = Annotated[Path | None, _O(help="The target cache folder (the same for `train --kd-cache`). Default: "
                                  "SPARECYCLES_CACHE/kd-targets.")]
Run = Annotated[str | None, _O(help="The run name of the teacher queue (sparecycles.teacher.RUN). Default: "
                               "kd-<teacher sha256[:12]>-<seed>, as `train --teacher-rounds` names it.")]
Window = Annotated[int, _O(min=1, max=4096, help="Teacher rounds out at once.")]
Timeout = Annotated[float, _O(min=0.001, help="Seconds a window waits for answers before sending the unanswered "
                              "steps again (workers may come and go).")]
Attempts = Annotated[int, _O(min=1, help="Sends per step before the fill stops (what it stored is kept).")]
Preset = Annotated[str, _O(help="Run preset or model preset, as for `train`: the defaults the settings override.")]
Progress = Annotated[bool, _O(help="Show a progress bar.")]


def default_cache() -> Path:
    """SPARECYCLES_CACHE/kd-targets (trainer.paths.cache_dir)."""
    from trainer.paths import cache_dir

    return cache_dir() / "kd-targets"


@kd_app.command("fill", cls=SettingsCommand)
@stops_cleanly
@with_settings()
def fill(settings: dict, redis_url: RedisUrl = "redis://127.0.0.1:6379/0", cache: Cache = None,
         preset: Preset = "demo", run: Run = None, window: Window = 32, timeout: Timeout = 120.0,
         attempts: Attempts = 5, progress: Progress = True) -> None:
    """Fill the target cache of the run these settings plan (the same --model, --data/--corpus, --batch-size,
    --seq-len, --seed, --steps, --teacher, --kd-estimator, --kd-k, --kd-temperature as its `train`): every step
    not stored yet is sent to the teacher workers, each answer checked and stored as it arrives. Resumable: a
    second invocation sends only the steps still missing. Prints the report as JSON; exit 2 for a refused
    option, 1 when steps stayed unanswered (rerun to resume)."""
    from trainer.run_options import RunOptions
    from trainer.train_cli import _resolve_checked

    cfg = _resolve_checked(preset, settings, RunOptions(eval_on="trainer"), None)
    if cfg.teacher is None or cfg.kd_estimator == "full" or cfg.task != "lm":
        raise typer.BadParameter("kd fill needs --teacher, the lm task and --kd-estimator sampled or topk (got "
                                 f"teacher {cfg.teacher!r}, task {cfg.task}, {cfg.kd_estimator})",
                                 param_hint="--teacher")
    if not redis_url.startswith(("redis://", "rediss://")):
        raise typer.BadParameter(f"a redis:// URL, got {redis_url!r}", param_hint="--redis-url")
    import redis
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from fleet.kd_fill import FillError, FillOptions
    from fleet.kd_fill import fill as run_fill
    from trainer.kd.teacher import check_tokenizers

    root = cache or default_cache()
    log = lambda m: typer.echo(m, err=True)  # noqa: E731
    bar = Progress(TextColumn("kd fill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   disable=not progress, transient=False)
    try:
        check_tokenizers(cfg.model, cfg.teacher)
        with bar:
            job = bar.add_task("fill", total=cfg.steps)
            report = run_fill(cfg, root, redis_url, FillOptions(run=run, window=window, timeout_s=timeout,
                                                                 attempts=attempts),
                              progress=lambda n: bar.advance(job, n), log=log)
    except FillError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc
    except (ValueError, OSError, redis.RedisError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(asdict(report), indent=2))
