"""How a run runs, as one typed model: `RunOptions`, every option of `train` and `up` that is not a training setting.

TrainConfig (trainer.config) is *what* is trained; RunOptions is *how this process runs it*: where held-out evaluation
runs and over which windows, when the trainer waits for a fleet, how long it waits to attach, torchrun, the metrics
server, teacher rounds and the target cache, resume/overwrite/export. Both commands get their options from it through
trainer.cli_settings (as TrainConfig's), so each option is declared once, with one default; a mode that needs another
says so in the field's description (`up` waits `interval` for its rounds unless --fleet-wait is given). The rules
between options are model validators: `RunOptions(...)` raises pydantic.ValidationError naming the option, without
any CLI. Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wire.bounds import MAX_SHARE, Share
from wire.messages import RunId

# --fleet-wait -> the round mode of fleet.attach (trainer.zo.rounds.RoundBook's fold timing)
FLEET_ROUNDS = {"never": "async", "interval": "next", "sync": "sync"}
UP_FLEET_WAIT = "interval"  # `up`'s fold timing unless --fleet-wait is given: its runs resume bit for bit
KD_WINDOW = 8  # steps of teacher rounds sent ahead by default
NOT_OPTIONS = ("fleet",)  # fields the commands set themselves, never generated as options

TEACHER_ROUNDS_ENV = "SPARECYCLES_TEACHER_ROUNDS"  # read by --teacher-rounds: a password stays out of argv
COORDINATOR = "--coordinator (or SPARECYCLES_COORDINATOR_URL)"  # what attaches `train` to a fleet
_F = Field


class RunOptions(BaseModel):
    """The run's options that are not training settings (module docstring). Raises pydantic.ValidationError for an
    option outside its choices or bounds, or a combination the validators refuse (each message names the option)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fleet: bool = _F(False, description="a fleet is attached (train --coordinator; up always has its own)")
    eval_on: Literal["trainer", "fleet", "auto"] = _F(
        "auto", description="where held-out evaluation runs: trainer, fleet (the trainer publishes the version and "
        "moves on; a version no worker answers for within --eval-deadline is evaluated here, and the record says so) "
        "or auto (fleet when one is attached and the trainer is one process)")
    eval_windows: Literal["subset", "full"] = _F(
        "subset", description="evaluation on the fleet: subset (the --eval-batches windows the trainer evaluates) or "
        "full (the whole validation split)")
    eval_deadline: float = _F(120.0, ge=0.0, allow_inf_nan=False, description="evaluation on the fleet: seconds "
                              "without a result before the trainer evaluates a version itself")
    fleet_wait: Literal["never", "interval", "sync"] | None = _F(
        None, description="with a fleet, when the trainer waits for a ZO-Curv probe round: never (a round folds at "
        "the first refresh after it completed; one that goes stale is skipped and counted), interval (each round "
        "folds at the refresh after it, waiting only when the fleet is a whole interval behind) or sync (each at its "
        "own refresh: the in-process run bit for bit). Unset: never for train, interval for up (its exact-resume "
        "mode)")
    attach_wait: float = _F(120.0, ge=0.0, allow_inf_nan=False, description="with --coordinator: seconds to wait "
                            "for the coordinator and at least one active probe worker before giving up")
    share: Share = _F(1.0, description="with --coordinator: this run's share of the fleet's pool (finite, > 0, at "
                      f"most {MAX_SHARE:g}): runs with work split the workers' time in proportion to their shares")
    require_fleet: bool = _F(False, description="with --coordinator: a run in which no probe round from the fleet "
                             "was ever applied (it equals AdamW) ends with an error (exit 1) instead of a warning")
    nproc_per_node: int | None = _F(None, ge=1, description="train under torchrun with N processes on this machine "
                                    "(DDP, the global batch split over the ranks; one per GPU with a CUDA device)")
    shard: bool = _F(False, description="under torchrun: shard parameters, gradients and AdamW state with FSDP2 "
                     "(first-order optimizers) instead of replicating them (DDP)")
    micro_batch_size: int | None = _F(None, ge=1, description="sequences per forward/backward on each rank; "
                                      "gradients accumulate over the rank's shard (first-order and ZO-Curv)")
    dist_timeout: float = _F(600.0, ge=1.0, allow_inf_nan=False, description="under torchrun: seconds a collective "
                             "waits for the other ranks before the run stops with an error")
    metrics_port: int | None = _F(None, ge=0, le=65535, description="serve Prometheus metrics on this port "
                                  "(default: 9102 with --coordinator, none without; 0: none)")
    metrics_host: str = _F("127.0.0.1", min_length=1, description="interface the metrics port binds (0.0.0.0 in "
                           "containers)")
    kd_window: int = _F(KD_WINDOW, ge=1, le=1024, description="with --teacher-rounds: steps of teacher rounds sent "
                        "ahead")
    kd_strict: bool = _F(False, description="with --teacher-rounds: wait for each step's targets instead of training "
                         "it on CE alone; none in 120 s stops the run (checkpointed), naming the queue")
    teacher_queue: RunId | None = _F(None, description="with --teacher-rounds: the run name RUN of the queue "
                                     "sparecycles.teacher.RUN its workers consume (default: kd-<12 hex of the "
                                     "teacher's sha256>-<seed>)")
    teacher_rounds: str | None = _F(
        None, pattern=r"^rediss?://", description="with --teacher: its targets from teacher rounds on the fleet "
        "through this redis:// URL instead of a teacher in this process; a step whose targets have not arrived "
        "trains on CE alone and is counted (kd_missing_steps). The env var keeps a password out of argv",
        json_schema_extra={"envvar": TEACHER_ROUNDS_ENV})
    kd_cache: Path | None = _F(None, description="with --teacher: read each step's targets from this target cache "
                               "(`sparecycles kd fill`) instead of a teacher")
    resume: bool = _F(False, description="continue from the run folder's checkpoint (another --steps re-plans "
                       "the lr decay and says how; a --warmup-steps left unset keeps the run's)")
    overwrite: bool = _F(False, description="start afresh in a run folder that already holds a run with other "
                         "settings")
    export: bool = _F(True, description="at the end, export the model as a transformers folder RUN_DIR/export")
    progress: bool = _F(True, description="show the live progress (plain lines when the output is no terminal)")

    @model_validator(mode="after")
    def _fleet_options_need_a_fleet(self) -> RunOptions:
        if not self.fleet:
            if self.fleet_wait:
                raise ValueError("--fleet-wait (and --fleet-sync) say when the trainer waits for a fleet's probe "
                                 f"rounds: they need {COORDINATOR}")
            if self.require_fleet:
                raise ValueError(f"--require-fleet needs {COORDINATOR}")
            if self.share != 1.0:
                raise ValueError(f"--share is a share of a fleet's pool: it needs {COORDINATOR}")
            if self.eval_on == "fleet":
                raise ValueError(f"--eval-on fleet needs {COORDINATOR}")
        if self.eval_on == "fleet" and (self.nproc_per_node or 1) > 1:
            raise ValueError(f"--eval-on fleet: a trainer of {self.nproc_per_node} ranks evaluates on its ranks (their "
                             "forward is collective); drop --eval-on fleet or --nproc-per-node")
        return self

    @model_validator(mode="after")
    def _resume_or_overwrite(self) -> RunOptions:
        if self.resume and self.overwrite:  # continue the folder's run, or start afresh: not both
            raise ValueError("--resume continues the run in the folder and --overwrite starts it afresh: give one "
                             "of them")
        return self

    @model_validator(mode="after")
    def _teacher_options_need_their_source(self) -> RunOptions:
        given = [f"--{n.replace('_', '-')}" for n in ("kd_strict", "teacher_queue") if getattr(self, n)]
        given += ["--kd-window"] if self.kd_window != KD_WINDOW else []
        if given and not self.teacher_rounds:
            raise ValueError(f"{', '.join(given)} say how the trainer sends and waits for teacher rounds: they need "
                             "--teacher-rounds")
        if self.kd_cache is not None and self.teacher_rounds:
            raise ValueError("--kd-cache replaces --teacher-rounds: give one of them")
        return self

    @property
    def eval_place(self) -> Literal["trainer", "fleet"]:
        """Where evaluation runs: auto is the fleet when one is attached and the trainer is one process."""
        if self.eval_on == "auto":
            return "fleet" if self.fleet and (self.nproc_per_node or 1) == 1 else "trainer"
        return self.eval_on

    def rounds(self, default: str = "never") -> str:
        """The round mode (fleet.attach.ROUND_MODES) of --fleet-wait, or of `default` when it is unset (`up`:
        UP_FLEET_WAIT)."""
        return FLEET_ROUNDS[self.fleet_wait or default]
