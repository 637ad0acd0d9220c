"""The training loop's step 6 (trainer.train): a finished run's report. The task's final metrics (every rank), then
by rank 0 loss.png, summary.json (initial and final figures, the time ledger, ranks, teacher rounds, skipped probe
rounds, the fleet's figures, evaluations, the anytime model's, the run's warnings) and (`export`) the model as a
transformers folder; `RunResult` is what `train()` returns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import health as run_health
from trainer.config import TrainConfig
from trainer.distributed import DistContext
from trainer.ledger import TimeLedger
from trainer.report import fleet_summary, plot_loss_curves


@dataclass(frozen=True)
class RunResult:
    """What a finished (or resumed-and-finished) run produced. Losses in nats/token; wall time in seconds."""

    run_dir: Path
    steps: int
    initial_val_loss: float
    final_val_loss: float
    wall_s: float
    summary: dict[str, Any]



def write_report(cfg: TrainConfig, s: Any, book: Any, ledger: TimeLedger, dist: DistContext, export: bool,
                 wall: float) -> RunResult:
    """Step 6: the task's final metrics (every rank), then by rank 0 loss.png, summary.json and (`export`) the
    model as a transformers folder. `s`, `book`: trainer.train's _Setup and _RunLog (not imported: train imports
    this module)."""
    task, model, run, vals = s.task, s.model, s.run, book.vals
    scalars = ("val_loss", "val_acc")
    initial = {k: v for k, v in vals[0].items() if k in scalars}
    last_val = {k: v for k, v in vals[max(vals)].items() if k in scalars}

    with ledger.phase("eval"):
        final = task.final(model)  # every rank: a sharded model's forward is collective
    full = dist.full_model(model, task.build_model) if export else model  # FSDP2: gathered on rank 0
    ranks = ranks_summary(model, dist)  # a collective: every rank
    if not dist.is_main:
        return RunResult(run.path, cfg.steps, initial["val_loss"], last_val["val_loss"], wall, {})
    with ledger.phase("log"):
        plot_loss_curves({cfg.optimizer: run.records()}, run.plot,
                         title=f"{task.model_name} on {task.data_name} ({cfg.optimizer})")
    ledger.stop()
    summary = {
        "model": task.model_name, "corpus": task.data_name, "optimizer": cfg.optimizer, "steps": cfg.steps,
        **{f"initial_{k}": v for k, v in initial.items()}, **{f"final_{k}": v for k, v in last_val.items()},
        "wall_s_this_invocation": wall, "tokens": cfg.steps * task.tokens_per_step, "resumed_from_step": s.start,
        "run_dir": str(run.path), **final, **ranks, "time_ledger": ledger.to_json(),
    }
    kd = s.loss_fn
    if hasattr(kd, "stats"):  # --teacher-rounds: targets taken, steps missing, bytes each way, over the whole run
        summary["kd"] = kd.stats()
        if s.start:  # a resumed run: this invocation's own counts beside them
            summary["kd_this_invocation"] = kd.this_part()
    rounds = rounds_summary(run.records())
    if rounds:
        summary["rounds_skipped"] = rounds
    fleet = fleet_summary(run.records())
    if fleet:  # a fleet-probed run: workers at the end and at most, tasks published and re-issued, results
        summary["fleet"] = fleet
    evals_by_fleet = [r for r in vals.values() if r.get("eval_on") is not None]
    if evals_by_fleet:
        summary["evaluations"] = {"fleet": sum(r["eval_on"] == "fleet" for r in evals_by_fleet),
                                  "trainer_fallback": sum(r["eval_on"] != "fleet" for r in evals_by_fleet)}
    if s.anytime is not None and s.anytime.last is not None:
        served = [r for r in run.records() if "served_val_loss" in r]
        summary.update(final_served_val_loss=served[-1]["served_val_loss"], final_served=served[-1]["served"])
    health = run_health.current()
    if health is not None:  # the run's warnings (trainer.health): what degraded, said in the summary too
        health.finish(run.records())
        summary.update(warnings=health.lines(), warning_counts=health.counts())
    run.write_summary(summary)
    if export:
        from trainer.export import export_trained

        export_trained(full, cfg.run_json(), run.path / "export", step=cfg.steps, run_dir=run.path)
    return RunResult(run.path, cfg.steps, initial["val_loss"], last_val["val_loss"], wall, summary)


def ranks_summary(model: torch.nn.Module, dist: DistContext) -> dict[str, Any]:
    """Who trained the run: `world_size` (processes), `rank_devices` (each rank's device, by rank) and `launcher`
    ("torchrun" when torchrun started the processes, even one; else "in process"). Every rank calls it."""
    device = str(next(model.parameters()).device)
    return {"world_size": dist.world, "rank_devices": dist.all_gather_object(device),
            "launcher": "torchrun" if dist.launched else "in process"}


def rounds_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """The probe rounds a ZO-Curv run never folded, from its step records: `dropped` (gone stale before they
    completed: skipped, never waited for) and `pending_at_end` (still out when the run ended); {} for a run
    without rounds."""
    out: dict[str, float] = {}
    for r in records:  # every round book's counters: <prefix>_dropped_rounds|pending_rounds (trainer.zo.rounds)
        for k, v in r.items():
            if k.endswith("_dropped_rounds"):
                out["dropped"] = v
            elif k.endswith("_pending_rounds"):
                out["pending_at_end"] = v
    return out
