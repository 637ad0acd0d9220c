"""`sparecycles bench regime run|report`: issue 29's comparison (benchmarks.regime), its options generated from
benchmarks.options.RegimeRunOptions (trainer.cli_settings). typer and stdlib at import; the work is imported inside.
`python -m benchmarks.regime_cli run|report` (tools/h200_regime.sh) is this same app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.options import RegimeRunOptions, parse
from trainer.cli_settings import SettingsCommand, with_settings

regime_app = typer.Typer(help="Issue 29's comparison: block-type lrs vs AdamW at large batch, a resumable plan "
                              "(benchmarks.regime).", no_args_is_help=True, rich_markup_mode=None)


@regime_app.command("run", cls=SettingsCommand)
@with_settings(model=RegimeRunOptions, param="given", section="Options")
def run(given: dict) -> None:
    """Run what the plan wants (re-planned after every finished run), --jobs at a time, until it has nothing left
    or --deadline-s passes; prints {"unfinished": [...], "finished": N}. Exit 1 when no run finished (each run's
    log under --out says why)."""
    from benchmarks.regime import PLANS, finished, run_plan

    o = parse(RegimeRunOptions, given)
    devices = o.devices
    if devices == "auto":
        import torch

        devices = "cuda" if torch.cuda.is_available() else "cpu"
    left = run_plan(o.plan, o.out, jobs=o.jobs, devices=devices.split(","), deadline_s=o.deadline_s,
                    settings={**PLANS[o.plan].settings, **o.overrides})
    n_done = len(finished(o.out))
    typer.echo(json.dumps({"unfinished": left, "finished": n_done}))
    if left and not n_done:
        typer.echo(f"no run finished; the logs under {o.out} say why", err=True)
        raise typer.Exit(1)


@regime_app.command("report")
def report(
    out: Annotated[Path, typer.Argument(help="writes regime_summary.json, regime.png and regime_tables.md here; "
                                             "reads its run folders")],
    more: Annotated[list[Path] | None, typer.Argument(help="further folders of run folders")] = None,
) -> None:
    """Score the finished runs: the table, JSON and PNG (benchmarks.regime_score). Exit 1 without a finished AdamW
    run to compare against."""
    from benchmarks.regime_score import report as score

    try:
        s = score(out, list(more or ()))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({k: v for k, v in s.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    regime_app(prog_name="python -m benchmarks.regime_cli")
