"""`up`'s own options as a typed model: `UpOptions`, what `up` runs and where.

TrainConfig is what both runs train, trainer.run_options.RunOptions how they run (shared with `train`), UpOptions
what only `up` decides: the preset and task, the fleet-probed optimizer, its folder, its workers and devices. The
`up` command's options are generated from all three (trainer.cli_settings); `plan_up(**given)` takes their fields
by name and sorts them to the model that owns each (`split_given`). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.serving_options import RequestRate
from fleet.devices import check_worker_count
from trainer.config import TrainConfig
from trainer.methods import fleet_method_names
from trainer.run_options import RunOptions

UP_RUN_OPTIONS = ("eval_on", "eval_windows", "eval_deadline", "fleet_wait", "nproc_per_node", "overwrite", "export",
                  "progress")  # the RunOptions that apply to `up` (the others are `train`'s alone)
NOT_UP_OPTIONS = tuple(n for n in RunOptions.model_fields if n not in UP_RUN_OPTIONS)
DEFAULT_OPTIMIZER = {"lm": "zocurv-line", "sentiment": "1.5spsa"}  # the fleet-probed run's, by task
SERVING_JSON = "serving.json"  # in `up`'s run folder: `--serving`'s figures (sparecycles.up_serving), that run's only


@dataclass(frozen=True)
class ServingDemo:
    """`up --serving`: the engine beside the workers, its request load (`rate` per second, `requests` in all) and the
    workers' hold (seconds idle before they take tasks again), how often they read the engine (seconds) and their
    tasks' CPU nice (the workers' --nice). Run by
    sparecycles.up_serving."""

    engine: str
    rate: float
    requests: int
    hold_s: float
    interval_s: float
    nice: int


def _others(task: str) -> str:
    return ", ".join(m for m in fleet_method_names(task) if m != DEFAULT_OPTIMIZER[task])


class UpOptions(BaseModel):
    """What `up` runs and where, and what serves beside it (`--serving`). Raises pydantic.ValidationError for a value
    outside its choices or bounds, a --serving-* setting without --serving vllm, --workers given beside
    --worker-devices with another count, or --workers given beside --gpus auto."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str = Field("demo", min_length=1, description="run preset (demo; with --task sentiment: sentiment-demo) "
                        "or a model preset: the defaults that the training settings override")
    task: Literal["lm", "sentiment"] = Field("lm", description="lm (pretraining, ZO-Curv) or sentiment (MiniLM-L6, "
                                             "pure ZO)")
    optimizer: str | None = Field(None, description="the fleet-probed optimizer (AdamW always runs as the baseline). "
                                  f"lm: {DEFAULT_OPTIMIZER['lm']} (default), {_others('lm')}; sentiment: "
                                  f"{DEFAULT_OPTIMIZER['sentiment']} (default), {_others('sentiment')}")
    workers: int = Field(2, ge=1, le=64, description="local probe worker processes on the CPU (--worker-devices "
                         "and --gpus auto place their own)")
    run_dir: Path | None = Field(None, description="run folder. Default: runs/up-<preset>-<optimizer>, plus the "
                                 "settings that differ from the preset's (e.g. -steps5) and -serving-vllm with "
                                 "--serving vllm")
    keep_blobs: bool = Field(False, description="keep the coordinator's weight blobs and Valkey files")
    device: str | None = Field(None, description="the trainer's device (both runs): cpu (default) or cuda:N")
    worker_devices: str | None = Field(None, description="one probe worker per listed device, e.g. cuda:1,cuda:2 "
                                       "(replaces --workers)")
    gpus: Literal["auto"] | None = Field(None, description="auto: the trainer on the first GPU, a probe worker on "
                                         "each other GPU (one GPU: both share it)")
    serving: Literal["none", "vllm"] = Field("none", description="a serving engine beside the workers. vllm: a real "
                                             "vLLM (CPU build, SmolLM2-135M; `bash tools/vllm.sh install` once) and "
                                             "an open-loop request load against it; every worker yields to it, and "
                                             "serving.json gets the load's latencies and the workers' figures")
    serving_rate: RequestRate = Field(0.1, description="with --serving vllm: the "
                                "request load's Poisson arrivals (requests per second)")
    serving_requests: int = Field(40, ge=1, le=10_000, description="with --serving vllm: requests the load sends "
                                  "(those not yet sent when the runs end are not sent)")
    serving_hold: float = Field(2.0, ge=0.0, le=3600.0, allow_inf_nan=False, description="with --serving vllm: "
                                "seconds the engine must read idle before a worker takes tasks again")
    serving_interval: float = Field(0.05, ge=0.01, le=10.0, allow_inf_nan=False, description="with --serving vllm: "
                                    "seconds between a worker's readings of the engine (the workers' "
                                    "--serving-interval: it bounds how late a worker sees a request)")
    serving_nice: int = Field(0, ge=0, le=19, description="with --serving vllm: the workers' --nice (their tasks' "
                              "CPU nice, and their session's). 0 here, not a worker's 19 beside an engine: up's "
                              "trainer shares these CPUs, and behind it a nice-19 worker starved (the fleet's "
                              "evaluations timed out); 19 suits a machine whose trainer runs elsewhere")

    @model_validator(mode="after")
    def _serving_settings_need_an_engine(self) -> UpOptions:
        given = sorted(n for n in self.model_fields_set if n.startswith("serving_"))
        if self.serving == "none" and given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies with --serving vllm only")
        return self

    @model_validator(mode="after")
    def _one_worker_count(self) -> UpOptions:
        check_worker_count(self.workers if "workers" in self.model_fields_set else None, self.worker_devices)
        return self

    @model_validator(mode="after")
    def _gpus_auto_counts_its_workers(self) -> UpOptions:
        # --gpus auto starts one worker per GPU after the first (fleet.devices.place); a --workers count beside it
        # would be silently ignored, so it is refused, whatever the count: the GPUs are only counted later.
        if self.gpus is not None and "workers" in self.model_fields_set:
            raise ValueError(f"--gpus {self.gpus} and --workers {self.workers} conflict: --gpus auto starts one probe "
                             "worker per GPU after the first (one GPU: one worker sharing it) and replaces --workers; "
                             "leave --workers out, or leave --gpus out and give --device cuda:0 --worker-devices "
                             "cuda:1,cuda:2 (one worker per listed device)")
        return self

    @property
    def fleet_optimizer(self) -> str:
        """The fleet-probed optimizer: --optimizer, else the task's default."""
        return self.optimizer or DEFAULT_OPTIMIZER[self.task]

    @property
    def serving_demo(self) -> ServingDemo | None:
        """The engine and load of `--serving`; None without one."""
        if self.serving == "none":
            return None
        return ServingDemo(self.serving, self.serving_rate, self.serving_requests, self.serving_hold,
                           self.serving_interval, self.serving_nice)

    @property
    def preset_for_task(self) -> str:
        """The run preset: --task sentiment turns the demo into sentiment-demo."""
        return "sentiment-demo" if self.task == "sentiment" and self.preset == "demo" else self.preset


class UpOverrides(BaseModel):
    """`up`'s repeatable KEY=VALUE options, each one generated option (trainer.cli_settings): `--set`, any training
    setting of both runs by its option's name (checked by sparecycles.up_plan.parse_train_options, naming it), and
    `--optimizer-option`, a knob of the fleet-probed run's optimizer (VALUE read as JSON; trainer.cli_settings.
    key_values). `plan_up(**overrides)` takes both by these names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train_options: tuple[str, ...] = Field((), description="KEY=VALUE: a training setting of both runs, by the name "
                                           "of its option below, e.g. --set lr=6e-4 --set warmup_steps=40 --set "
                                           "corpus=classics", json_schema_extra={"name": "set", "repeat": True,
                                                                                 "metavar": "KEY=VALUE"})
    optimizer_options: dict[str, Any] = Field({}, description="KEY=VALUE: a knob of the fleet-probed run's "
                                              "optimizer, e.g. start=one for zocurv-trust, s_max=8 for zocurv-line; "
                                              "the folder name gets -KEY-VALUE")


def split_given(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(UpOptions, RunOptions, TrainConfig) keyword arguments from `plan_up`'s keywords, each to the model that owns
    its name. Raises TypeError for a name none of them has."""
    up, run, cfg = {}, {}, {}
    for key, value in given.items():
        owner = up if key in UpOptions.model_fields else run if key in RunOptions.model_fields else cfg
        if owner is cfg and key not in TrainConfig.model_fields:
            raise TypeError(f"plan_up() got an unexpected keyword argument {key!r}")
        owner[key] = value
    return up, run, cfg
