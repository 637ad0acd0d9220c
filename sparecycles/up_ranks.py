"""`up --nproc-per-node N`: each of `up`'s runs trained under torchrun with N ranks, rank 0 on `up`'s fleet.

The run's TrainConfig, as `plan_up` decided it, goes whole to the ranks as JSON (`logs/<run>.config.json`, read
by the hidden `train --config`); trainer.launch.launch_torchrun, the launcher of `train --nproc-per-node`, starts
`sparecycles train` on every rank. Rank 0 attaches to `up`'s coordinator as `train --coordinator` does (admin
token, Redis URL, key prefix and blob folder in the environment, never on a command line) and broadcasts the
rounds' results to the others (trainer.dist_backends); the runs' rounds fold as `up`'s do (`--fleet-wait`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


def launch_note(plan: Any) -> str:
    """The line `up` prints about its trainer when `plan.nproc` is set: ranks, devices, process-group backend."""
    cuda = plan.zo_cfg.device.startswith("cuda")
    where = (f"cuda:0..{plan.nproc - 1}" if plan.nproc > 1 else plan.zo_cfg.device) if cuda else "the CPU"
    backend = "nccl" if cuda else "gloo (torch.distributed's CPU backend)"
    evaluation = "; evaluation on the ranks" if plan.nproc > 1 else ""
    return (f"trainer: {plan.nproc} rank(s) under torchrun on {where}, process group {backend}; rank 0 talks to "
            f"the coordinator{evaluation}")


@dataclass(frozen=True)
class RankRun:
    """How one of `up`'s runs runs on its ranks: `resume` (an interrupted run continues), `progress` (the live
    display), `export` (the transformers folder at the end), `metrics_port` (the trainer's), `coordinator` (`up`'s
    coordinator URL, for rank 0 when the run sends it probes or evaluations; None: no fleet) and `teacher_queue`
    (the run's teacher round queue; None: no teacher rounds)."""

    resume: bool
    progress: bool
    export: bool
    metrics_port: int
    coordinator: str | None = None
    teacher_queue: str | None = None


def rank_args(plan: Any, cfg: Any, *, config_path: Path, run: RankRun) -> list[str]:
    """`sparecycles train` arguments of one of `up`'s runs (writes `cfg` to `config_path`): the whole config, the
    run folder taken over as `up`'s in-process runs take it (`--overwrite`; `--resume` for an interrupted run), the
    fleet when the run sends it probes or evaluations (`run.coordinator`, with `plan`'s --fleet-wait and evaluation
    options), the trainer's metrics port, and with `run.teacher_queue` the run's teacher rounds on that queue (the
    Redis URL comes in $SPARECYCLES_TEACHER_ROUNDS; `--kd-strict` unless plan.fleet_wait is "never", as `up`'s
    in-process runs wait)."""
    fleet_wait = plan.fleet_wait
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(cfg.model_dump_json(indent=2))
    args = ["train", "--config", str(config_path), "--overwrite", "--export" if run.export else "--no-export",
            "--progress" if run.progress else "--no-progress", "--metrics-port", str(run.metrics_port)]
    args += ["--resume"] if run.resume else []
    if run.teacher_queue is not None:
        args += ["--teacher-queue", run.teacher_queue, *(["--kd-strict"] if fleet_wait != "never" else [])]
    if run.coordinator is None:
        return [*args, "--eval-on", "trainer"]
    return [*args, "--coordinator", run.coordinator, "--fleet-wait", fleet_wait, "--eval-on", plan.eval_on,
            "--eval-windows", plan.eval_windows, "--eval-deadline", str(plan.eval_deadline)]


def train_ranks(plan: Any, name: str, cfg: Any, *, run: RankRun, env: dict[str, str],
                preexec_fn: Callable[[], None] | None = None) -> None:
    """Train `up`'s run `name` (config `cfg`) under torchrun with `plan.nproc` ranks; returns when they finished.
    `run.coordinator`: `up`'s coordinator URL, handed to rank 0 when the run probes or evaluates there; `env`: the
    ranks' environment (the fleet's credentials; with teacher rounds, their URL).

    Raises:
        RuntimeError: the ranks exited with an error (their output went to this console).
        KeyboardInterrupt: Ctrl-C or SIGTERM, passed on to the ranks (they checkpoint), raised once they stopped.
    """
    from trainer.launch import launch_torchrun

    probes = name != "adamw"
    fleet = probes or plan.eval_on == "fleet"
    args = rank_args(plan, cfg, config_path=plan.out / "logs" / f"{name}.config.json",
                     run=run if fleet else replace(run, coordinator=None))
    code = launch_torchrun(plan.nproc, args, env=env, preexec_fn=preexec_fn)
    if code:
        raise RuntimeError(f"{name}: the trainer's {plan.nproc} rank(s) under torchrun exited with code {code} "
                           "(their output is above); rerun the same command to resume")
