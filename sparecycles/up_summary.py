"""`sparecycles up`'s summary: summary.json's figures (written once, with the folder's disk use) and the console's last
lines (one per run, `--serving`'s, and where summary.json is)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparecycles.up_plan import disk_use

if TYPE_CHECKING:
    from sparecycles.up_plan import UpPlan


def run_summary(run_dir: Path) -> dict:
    """Initial/final validation figures (loss, and accuracy for classifiers) and test figures of a finished run."""
    s = json.loads((run_dir / "summary.json").read_text())
    keys = [k for k in s if k.startswith(("initial_val_", "final_val_", "test_"))]
    return {**{k: s[k] for k in keys}, **({"time_ledger": s["time_ledger"]} if "time_ledger" in s else {}),
            **({"evaluations": s["evaluations"]} if "evaluations" in s else {}),
            **({"kd": s["kd"]} if "kd" in s else {}),  # teacher rounds over the whole run: taught, missing, bytes
            **({"kd_this_invocation": s["kd_this_invocation"]} if "kd_this_invocation" in s else {}),  # --resume
            **({"warnings": s["warnings"]} if s.get("warnings") else {})}  # the run's health (trainer.health)


def names(plan: UpPlan) -> tuple[str, str]:
    """The model's and the data's names for the title and summary: a folder --model by its name, --data as given."""
    from trainer.models.causal_lm import model_label

    if plan.task == "sentiment":
        return "minilm-l6", "sentiment"
    return model_label(plan.zo_cfg.model), str(plan.zo_cfg.data or plan.zo_cfg.corpus)


def title(plan: UpPlan) -> str:
    model_name, data_name = names(plan)
    return (f"{model_name} on {data_name}: {plan.optimizer} (fleet of {plan.workers}) vs AdamW, "
            f"{plan.zo_cfg.steps} steps")


@dataclass(frozen=True)
class UpOutcome:
    """What one `up` invocation reused and trained, for summary.json: the finished runs it reused, the fleet's
    figures (summed over the fleet-probed run's parts), where Redis came from, and `extra` (`--serving`'s
    figures, or {})."""

    reused: list[str]
    fleet: dict
    redis_desc: str
    extra: dict


def build_summary(plan: UpPlan, outcome: UpOutcome, *, rounds: str, teacher: str, late: str | None, png: Path,
                  wall_s: float) -> dict:
    """summary.json's figures (less `disk_mb`, which `write_summary` adds): the settings, each run's figures
    (run_summary), the fleet's and what was reused (`outcome`), `rounds` and `teacher` (sparecycles.up's notes) and
    where evaluation ran, warnings (the plan's, `late`, each run's), wall seconds, the plot and logs, and
    `outcome.extra` (serving)."""
    out, opt = plan.out, plan.optimizer
    reused, fleet, redis_desc, extra = outcome.reused, outcome.fleet, outcome.redis_desc, outcome.extra
    model_name, data_name = names(plan)
    summary = {
        "task": plan.task, "preset": plan.preset, "model": model_name, "corpus": data_name, "steps": plan.zo_cfg.steps,
        "workers": plan.workers, "optimizer": opt, "redis": redis_desc, "reused": reused,
        "adamw": run_summary(out / "adamw"), opt: run_summary(out / opt), "fleet": fleet,
        "trainer_device": plan.zo_cfg.device, "trainer_ranks": plan.nproc or 1,
        "trainer_launch": "in process" if plan.nproc is None else f"torchrun --nproc-per-node {plan.nproc}",
        "worker_devices": list(plan.worker_devices or ("cpu",) * plan.workers),
        "forward_dtype": "float32 (TF32 matmuls on CUDA)" if any(d.startswith("cuda") for d in plan.worker_devices)
        else "float32",
        "rounds": rounds, "teacher": teacher, "evaluation": eval_note(plan),
        "warnings": [*plan.warnings, *([late] if late else [])], "wall_s": wall_s, "plot": str(png),
        "logs": str(out / "logs"), **extra,
    }
    summary["warnings"] += [f"{name}: {w}" for name in ("adamw", opt) for w in summary[name].get("warnings", [])]
    return summary


def eval_note(plan: UpPlan) -> str:
    """Where `up`'s runs are evaluated, for summary.json."""
    if plan.eval_on != "fleet":
        return "on the trainer"
    return (f"on the fleet ({'the whole validation split' if plan.eval_windows == 'full' else 'the eval_batches subset'}"
            f"; a version no worker answers for in {plan.eval_deadline:.0f} s is evaluated by the trainer)")


def write_summary(out: Path, summary: dict) -> dict:
    """Add the folder's disk use (MB per entry and in all; summary.json itself not counted: it is written after)
    to `summary` and write it to `out/summary.json`, once. Returns it."""
    sizes = {k: v for k, v in disk_use(out).items() if k != "summary.json"}
    summary["disk_mb"] = {k: round(v / 2**20, 1) for k, v in sizes.items()}
    summary["disk_mb"]["total"] = round(sum(sizes.values()) / 2**20, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def end_lines(summary: dict, out: Path) -> list[str]:
    """`up`'s last lines on the console: one per run (validation loss first -> final, accuracy for classifiers; the
    fleet-probed run with the fleet's results accepted, stale and probes/s), one for `--serving` (requests answered,
    p95 end to end against the engine alone, the share of the engine's idle seconds the workers used), and one
    pointing at summary.json with the plot, disk use and wall seconds."""
    lines = []
    for name in ("adamw", summary["optimizer"]):
        run = summary[name]
        line = f"{name}: val loss {run['initial_val_loss']:.4f} -> {run['final_val_loss']:.4f}"
        if "final_val_acc" in run:
            line += f", val accuracy {run['final_val_acc']:.3f}"
        line += f" after {summary['steps']} steps" + (" (reused)" if name in summary["reused"] else "")
        fleet = summary.get("fleet") or {}
        if name != "adamw" and "results_accepted" in fleet:
            line += (f"; fleet of {summary['workers']}: {fleet['results_accepted']:.0f} results accepted, "
                     f"{fleet.get('results_stale', 0):.0f} stale, {fleet.get('probes_per_s', 0):.2f} probes/s")
        lines.append(line)
    if "serving" in summary:
        from sparecycles.up_serving import serving_line

        lines.append(serving_line(summary["serving"]))
    disk = summary.get("disk_mb", {}).get("total")
    lines.append(f"every figure: {out / 'summary.json'} (plot {Path(summary['plot']).name}"
                 + (f", {disk:.1f} MB on disk" if disk is not None else "") + f", wall {summary['wall_s']:.0f} s)")
    return lines
