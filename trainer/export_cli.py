"""`sparecycles export RUN_DIR OUT_DIR`: a run folder's model as a transformers folder (trainer.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict, Field

from trainer.cli_settings import build, with_settings


class ExportOptions(BaseModel):
    """`export`'s options, each one generated option of the command (trainer.cli_settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partial: bool = Field(False, description="Export the checkpoint of an unfinished (interrupted) run")
    overwrite: bool = Field(False, description="Replace an earlier export in OUT_DIR (never a run or any other folder)")
    best: bool = Field(False, description="Export the served anytime model (RUN_DIR/served.safetensors, a run "
                       "trained with --anytime) instead of the trained weights")


@with_settings(model=ExportOptions, param="given", section="Options")
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="Run folder of `sparecycles train` or `sparecycles up`.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Output folder (config.json, model.safetensors, tokenizer).")],
    given: dict,
) -> None:
    """Export a finished run's model for `transformers`: AutoModelForCausalLM (a GPT-2 preset, or your --model
    folder's class: Llama, Qwen2, ...) or AutoModelForSequenceClassification (the MiniLM sentiment classifier)
    `.from_pretrained(OUT_DIR)`, with the run's tokenizer."""
    from trainer.run_dir import not_a_run_folder

    o = build(ExportOptions, given)
    why = not_a_run_folder(run_dir)  # before the heavy imports (torch, transformers) of trainer.export
    if why is not None:
        typer.secho(f"error: {why}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    from trainer.export import ExportError, export_run

    try:
        out = export_run(run_dir, out_dir, partial=o.partial, overwrite=o.overwrite, best=o.best)
    except (ExportError, FileExistsError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"exported {run_dir} to {out} (load with transformers' from_pretrained)")
