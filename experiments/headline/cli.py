"""`python -m experiments.headline report|memory`: the headline pretraining report and the in-place memory scan
(experiments.headline.bench; experiments/headline/run.sh runs the whole set on a GPU machine). Run from the
repository root (experiments/ is not installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict, Field

from benchmarks.options import parse
from sparecycles.cli_errors import OneLineErrors
from trainer.cli_settings import SettingsCommand, with_settings

SECTION = "Options"


class HeadlineReportOptions(BaseModel):
    """`python -m experiments.headline report`: the pretraining report of finished runs (experiments.headline.bench.pretrain_report)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path = Field(Path("runs/headline"), description="folder for pretrain_summary.json and pretrain_val_loss.png")


class MemoryScanOptions(BaseModel):
    """`python -m experiments.headline memory`: the largest GPT shape that trains in place on one GPU (experiments.headline.bench)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field("cuda", description="CUDA device")
    shapes: tuple[str, ...] = Field(("gpt2-xl", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-30b", "gpt-45b"), min_length=1,
                                 description="comma-separated shapes, ascending (experiments.headline.bench.SCAN_SHAPES)")
    seq_len: int = Field(1024, ge=1, le=1024, description="tokens per sequence (batch 1)")
    json_out: Path | None = Field(None, description="write the scan as JSON here")


headline_app = typer.Typer(cls=OneLineErrors, rich_markup_mode=None, no_args_is_help=True,
                           help="Headline benchmarks: pretraining report, memory scan (experiments/headline/run.sh "
                           "runs the whole set on a GPU machine).")


@headline_app.command("report", cls=SettingsCommand)
@with_settings(model=HeadlineReportOptions, param="given", section=SECTION)
def report(
    runs: Annotated[list[Path], typer.Argument(help="finished `sparecycles train` run folders (one AdamW at least)")],
    given: dict,
) -> None:
    """Validation loss at equal steps, and steps / wall time to reach each AdamW reference's final loss."""
    from experiments.headline.bench import pretrain_report

    out = parse(HeadlineReportOptions, given).out
    missing = [str(r) for r in runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        raise typer.BadParameter(f"not run folders (no metrics.jsonl): {', '.join(missing)}")
    try:
        res = pretrain_report(runs, out)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    for name, r in res["runs"].items():
        same = r.get("same_lr_adamw", {})
        typer.echo(f"{name}: final val {r['final_val_loss']:.4f}; reaches best AdamW final at step "
                   f"{r['best_adamw']['step_reached']} (ratio {r['best_adamw']['step_ratio']}); same-lr AdamW "
                   f"final at step {same.get('step_reached')} (ratio {same.get('step_ratio')})")
    typer.echo(f"wrote {out / 'pretrain_summary.json'} and {out / 'pretrain_val_loss.png'}")


@headline_app.command("memory", cls=SettingsCommand)
@with_settings(model=MemoryScanOptions, param="given", section=SECTION)
def memory(given: dict) -> None:
    """Largest GPT shape that takes a training step in place with AdamW vs 1.5-SPSA on one GPU; peak memory."""
    from experiments.headline.bench import memory_scan

    o = parse(MemoryScanOptions, given)
    try:
        res = memory_scan(o.device, o.shapes, seq_len=o.seq_len)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    for t in res["trials"]:
        typer.echo(f"{t['method']:8s} {t['shape']:9s} {t['params'] / 1e9:6.2f}B params  "
                   f"{'ok ' if t['ok'] else 'OOM'} peak {t['peak_bytes'] / 2**30:7.1f} GiB")
    typer.echo(f"largest: {res['largest']} on {res['gpu']} ({res['gpu_bytes'] / 2**30:.0f} GiB)")
    if o.json_out is not None:
        o.json_out.parent.mkdir(parents=True, exist_ok=True)
        o.json_out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    headline_app(prog_name="python -m experiments.headline")
