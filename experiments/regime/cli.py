"""`python -m experiments.regime run|report`: block-type lrs vs AdamW at large batch (experiments.regime.plan), its
options generated from RegimeRunOptions (trainer.cli_settings). Run from the repository root (experiments/ is not
installed); experiments/regime/run.sh runs it on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.options import parse
from experiments.regime.plan import PLANS
from fleet.devices import devices_here
from sparecycles.cli_errors import OneLineErrors
from trainer.cli_settings import SettingsCommand, with_settings
from trainer.config import TrainConfig
from trainer.run_options import RunOptions


def _override(model: type[BaseModel], name: str) -> Any:
    """`model`'s field `name` as an optional override of it: its type and bounds (declared there once), or None."""
    info = model.model_fields[name]
    return Annotated[(info.annotation | None, *info.metadata)]


_BatchSize, _SeqLen = _override(TrainConfig, "batch_size"), _override(TrainConfig, "seq_len")
_Corpus, _Model = _override(TrainConfig, "corpus"), _override(TrainConfig, "model")
_MicroBatchSize = _override(RunOptions, "micro_batch_size")
PlanName = Literal[tuple(PLANS)]  # experiments.regime.plan.PLANS' names: a plan added there is a choice here


class RegimeRunOptions(BaseModel):
    """`python -m experiments.regime run`: issue 29's resumable plan (experiments.regime.plan.run_plan). The overrides of the plan's run
    settings take TrainConfig's (and RunOptions') bounds; unset, the plan's own settings stand."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: PlanName = Field(description="the plan: full (64x1024), h200, h200b, h200c, h200d (one-GPU calls) or cpu "
                        "(a tiny dry run); experiments.regime.plan.PLANS")
    out: Path = Field(description="folder of the run folders (resumable: finished runs are kept)")
    jobs: int = Field(4, ge=1, le=256, description="runs at a time (one process each)")
    devices: str = Field("auto", min_length=1, description="comma-separated devices, runs spread round-robin; auto: "
                      "cuda when torch sees a GPU, else cpu")
    deadline_s: float = Field(440.0, gt=0.0, allow_inf_nan=False, description="seconds after which the runs still "
                           "going are stopped (checkpointed) and no other starts")
    batch_size: _BatchSize = Field(None, description="override the plan's sequences per step")
    seq_len: _SeqLen = Field(None, description="override the plan's tokens per sequence")
    corpus: _Corpus = Field(None, description="override the plan's corpus")
    model: _Model = Field(None, description="override the plan's model preset")
    micro_batch_size: _MicroBatchSize = Field(None, description="sequences per forward/backward: each step's gradients "
                                           "accumulate over batch/M passes (M must divide the batch)")

    @model_validator(mode="after")
    def _devices_here(self) -> RegimeRunOptions:
        if self.devices != "auto":  # a CUDA device this machine lacks is refused before any run starts
            devices_here(self.devices, "--devices")
        return self

    @property
    def overrides(self) -> dict[str, Any]:
        """The plan settings given ({setting: value}; unset ones left out)."""
        return {k: v for k in ("batch_size", "seq_len", "corpus", "model", "micro_batch_size")
                if (v := getattr(self, k)) is not None}


regime_app = typer.Typer(cls=OneLineErrors, help="Block-type lrs vs AdamW at large batch: a resumable plan of full "
                         "schedules (experiments.regime.plan; experiments/regime/README.md).", no_args_is_help=True,
                         rich_markup_mode=None)


@regime_app.command("run", cls=SettingsCommand)
@with_settings(model=RegimeRunOptions, param="given", section="Options")
def run(given: dict) -> None:
    """Run what the plan wants (re-planned after every finished run), --jobs at a time, until it has nothing left
    or --deadline-s passes; prints {"unfinished": [...], "finished": N}. Exit 1 when no run finished (each run's
    log under --out says why)."""
    from experiments.regime.plan import finished, run_plan

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
    """Score the finished runs: the table, JSON and PNG (experiments.regime.score). Exit 1 without a finished AdamW
    run to compare against."""
    from experiments.regime.score import report as score

    try:
        s = score(out, list(more or ()))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({k: v for k, v in s.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    regime_app(prog_name="python -m experiments.regime")
