"""How a probe worker runs, as one typed model: `WorkerOptions`, every option of `sparecycles worker`.

The command's options are generated from these fields by trainer.cli_settings (as `train`'s from TrainConfig and
RunOptions): each option is declared once, here, with one default, its bounds and its help (the description).
Yielding to a serving engine is probe_worker.serving.ServingPolicy, nested as `serving`, its sub-fields spelled
`--serving-*` (the field's "options"). The rules between options are model validators: `WorkerOptions(...)` raises
pydantic.ValidationError naming the option, without any CLI. Torch-free (imported when the CLI is built).

Add an option: a field here (default, bounds, description; "envvar"/"repeat" in json_schema_extra if it needs
them), a validator if it depends on another option, and its use in probe_worker.worker.ProbeWorker (`self.opts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from probe_worker.serving import ServingPolicy

_F = Field


def _checked(ok: Any, message: str) -> AfterValidator:
    """A validator (in the field's type, so its option refuses the value too) raising ValueError(message)."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(message)
        return value

    return AfterValidator(check)


BaseUrl = Annotated[str, _checked(lambda v: v.startswith(("http://", "https://")),
                                  "the coordinator's base URL must be http(s)://...")]
HttpUrl = Annotated[str, _checked(lambda v: v.startswith(("http://", "https://")), "use http(s)://...")]
Device = Annotated[str, _checked(lambda v: v.startswith(("cpu", "cuda")), "use cpu or cuda:N")]
QueueName = Annotated[str, _checked(lambda v: bool(v) and not any(c.isspace() for c in v),
                                    "a queue name without spaces, e.g. sparecycles.teacher.RUN (`train` prints it)")]


def _folder(path: Path) -> Path:
    """`path` unless it, or a folder above it, is a file (ValueError naming it): checked before the worker starts."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{path} {'is' if blocker == path else f'is under {blocker},'} a file: give a folder")
    return path


Folder = Annotated[Path, AfterValidator(_folder)]
LogLevel = Annotated[str, _checked(lambda v: v.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                                   "use DEBUG, INFO, WARNING, ERROR or CRITICAL"), AfterValidator(str.upper)]
SERVING_OPTIONS = {  # ServingPolicy's sub-fields as `worker` spells them (scrape_timeout_s keeps its default)
    "metrics_url": {"name": "serving_metrics", "envvar": "SPARECYCLES_SERVING_METRICS",
                    "help": "yield to the serving engine beside this worker: vLLM's /load (started with "
                    "--enable-server-load-tracking, else it always reads 0), e.g. http://127.0.0.1:8000/load, or a "
                    "Prometheus endpoint (…/metrics), read every --serving-interval (docs/serving.md)"},
    "engine": {"help": "whose queue gauges to read: auto, vllm, sglang, tgi or llamacpp"},
    "gauges": {"repeat": True, "help": "a gauge to read instead (any engine)"},
    "busy_above": {"help": "the engine is busy while its gauges sum above this (requests)"},
    "hold_s": {"name": "serving_hold", "envvar": "SPARECYCLES_SERVING_HOLD",
               "help": "seconds the engine must read idle before the worker takes tasks again"},
    "scrape_timeout_s": None,
    "interval_s": {"name": "serving_interval", "help": "seconds between readings of the engine (default: "
                   "--control-interval; it bounds how late the worker sees a request); while yielding to a busy "
                   "engine or drained: the larger of it and --control-interval"},
    "freeze_s": {"name": "serving_freeze", "help": "stop the worker (SIGSTOP, from a watcher process of normal "
                 "priority) while the engine serves during a task, for at most this many seconds (and a third of "
                 "the coordinator's lease); the task goes on when the engine reads idle. Only where the worker leads "
                 "its session (`setsid -w`, a service manager, `up`). 0: no watcher, tasks are only cut in process "
                 "(docs/serving.md)"},
}


class WorkerOptions(BaseModel):
    """One worker process's options (module docstring). Durations in seconds. Raises pydantic.ValidationError for a
    value outside its choices or bounds, or a combination the validators refuse (each message names the option)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: BaseUrl = _F(json_schema_extra={"envvar": ["SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_COORDINATOR"]},
                              description="coordinator base URL, e.g. http://10.0.0.5:8000")
    token: str = _F(json_schema_extra={"envvar": "SPARECYCLES_ENROLLMENT_TOKEN"},
                    description="enrollment token (from the coordinator's operator)")
    device: Device = _F("cpu", description="torch device: cpu or cuda:N (one worker per GPU)")
    name: str | None = _F(None, description="name shown in GET /v1/workers (default: HOST-DEVICE)")
    metrics_port: int | None = _F(None, ge=0, le=65535, description="serve Prometheus metrics on this port "
                                  "(default: none; 0: none, as `train`'s)")
    metrics_host: str = _F("127.0.0.1", min_length=1, description="interface the metrics port binds (0.0.0.0 in "
                           "containers, where Prometheus scrapes it from another one)")
    cache_dir: Folder | None = _F(None, description="weight cache (default: cache root/worker)")
    keep_versions: int = _F(2, ge=1, description="weight versions kept loaded")
    blob_dir: Folder | None = _F(None, json_schema_extra={"envvar": "SPARECYCLES_BLOB_DIR"}, description="the "
                               "coordinator's blob directory, when this worker shares its file system: weight shards "
                               "are read there in place instead of downloaded")
    control_interval: float = _F(0.5, ge=0.05, allow_inf_nan=False, description="seconds between heartbeats/drain "
                                 "checks")
    # Celery's worker_soft_shutdown_timeout (with soft shutdown on idle): Celery >= 5.5 applies it to a cold
    # shutdown only; under the solo pool its wait runs in the signal handler, on the task's own (main) thread.
    soft_shutdown: float = _F(30.0, ge=0.0, allow_inf_nan=False, description="seconds a cold shutdown (SIGQUIT, or "
                              "a second Ctrl-C) waits, idle or not, before it cuts the running task, which does not "
                              "advance meanwhile (the wait holds its thread); 0: it cuts at once. SIGTERM, a warm "
                              "shutdown, does not use it: the worker takes no further task and waits for the running "
                              "one however long it takes")
    prefetch_interval: float = _F(1.0, ge=0.0, allow_inf_nan=False, description="seconds between checks for a new "
                                  "version to load ahead of its rounds (with one run: back-to-back 2 s long polls "
                                  "instead; 0: load at the first task)")
    yield_gpu_util: float | None = _F(None, ge=1.0, le=100.0, description="drain while other work keeps the GPU at "
                                      "least this busy (percent; needs --device cuda:N and nvidia-ml-py)")
    threads: int | None = _F(None, ge=1, description="torch CPU threads (default: torch's)")
    probe_path: Literal["auto", "whole", "per_unit"] = _F(
        "auto", description="auto (a whole-model scratch copy when it fits in free memory, else per-unit), whole or "
        "per_unit")
    cuda_graphs: bool = _F(False, description="replay the compiled forwards as CUDA graphs (shapes are static per "
                           "round)")
    tf32_attention: Literal["auto", "fp32", "bf16"] = _F(
        "auto", description="attention of the fp32/TF32 kinds' forwards: auto (bf16 on CUDA, fp32 on CPU), fp32, or "
        "bf16 (activations only; the weights and their perturbation stay fp32; docs/RESULTS.md has its "
        "signal-to-noise)")
    teacher_engine: HttpUrl | None = _F(None, description="answer teacher rounds (--kd-estimator topk) through this "
                                        "serving engine's OpenAI-compatible API, never loading the teacher "
                                        "(docs/engine-teacher.md); without it, the worker answers them with the "
                                        "teacher loaded in its process")
    teacher_queues: tuple[QueueName, ...] = _F((), json_schema_extra={"repeat": True}, description="a teacher round queue "
                                         "to consume besides those registered at the coordinator, for a trainer that "
                                         "registers none (`train` prints it)")
    teacher_pause: float = _F(0.0, ge=0.0, allow_inf_nan=False, description="hold each teacher round this long "
                              "before answering it (seconds; for redelivery tests: a worker killed while it holds one)")
    nice: int | None = _F(None, ge=0, le=19, description="run tasks at this lower CPU priority (Linux nice; 0: "
                          "unchanged; default: 19 beside a serving engine, with --serving-metrics, else 0). The "
                          "process's autogroup gets it too, so it holds against an engine of another session "
                          "(docs/serving.md); the engine's watch and the heartbeats keep the normal priority")
    sched_idle: bool = _F(False, description="run tasks under Linux's SCHED_IDLE policy (alone or with --nice): a "
                          "task of normal priority that wakes preempts them at once, where nice 19 still lets them "
                          "finish a time slice")
    log_level: LogLevel = _F("INFO", description="log level (DEBUG, INFO, WARNING, ERROR or CRITICAL; any case)")
    serving: ServingPolicy | None = _F(None, json_schema_extra={"switch": False, "options": SERVING_OPTIONS},
                                       description="yielding to a serving engine beside this worker")
    task_trace: Path | None = _F(None, description="append each task's start, end and outcome there (JSON lines; "
                                 "`bench serving` plots them)")

    @model_validator(mode="before")
    @classmethod
    def _serving_options_need_its_metrics(cls, data: Any) -> Any:
        serving = data.get("serving") if isinstance(data, dict) else None
        if isinstance(serving, dict) and "metrics_url" not in serving:
            raise ValueError("the --serving-* options need --serving-metrics URL")
        return data

    @model_validator(mode="after")
    def _device_rules(self) -> WorkerOptions:
        cuda_only = [o for o, on in (("--yield-gpu-util", self.yield_gpu_util is not None),
                                     ("--cuda-graphs", self.cuda_graphs)) if on]
        if cuda_only and not self.device.startswith("cuda"):
            raise ValueError(f"{' and '.join(cuda_only)} {'need' if len(cuda_only) > 1 else 'needs'} --device cuda:N "
                             f"(got {self.device})")
        return self

    @property
    def task_nice(self) -> int:
        """The nice the tasks run at: --nice, else 19 beside a serving engine (--serving-metrics), else 0 (unchanged).
        A worker that yields to an engine gives it the core while it yields too: without the lower priority a request
        that arrives during a task shares the core half and half until the task is cut (docs/serving.md)."""
        if self.nice is not None:
            return self.nice
        return 19 if self.serving is not None else 0

    @model_validator(mode="after")
    def _teacher_rules(self) -> WorkerOptions:
        if self.teacher_pause and self.teacher_engine:
            raise ValueError("--teacher-pause holds rounds of the teacher loaded here; --teacher-engine answers "
                             "through the engine, which never holds one: leave one out")
        if self.teacher_pause and not self.teacher_queues:
            raise ValueError("--teacher-pause holds teacher rounds: name their queue with --teacher-queue")
        return self


