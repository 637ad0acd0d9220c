"""The options of `sparecycles bench fleet`, `bench intake`, `bench precision`, `bench kernels`, ..., as typed models.

Each command's options are generated from these fields by trainer.cli_settings (as `train`'s from TrainConfig): one
declaration per option, with its default, bounds and help (the description); "name" in json_schema_extra spells an
option otherwise than its field (`print_json` is `--json`), "envvar" reads a variable when the option is not given.
The run functions take the model (benchmarks.fleet.run_fleet_bench). `parse(model, given)` builds one from a
command's values and turns a refusal into typer.BadParameter (exit 2) naming the option; the rules between options
are model validators (testable without the CLI). The experiments' command lines (experiments/) use `parse` too.
Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from benchmarks import RESULTS
from fleet.devices import device_here, devices_here
from probe_worker.options import WorkerOptions
from trainer.models.presets import get_preset

_F = Field
_WORKER = WorkerOptions.model_fields  # the worker options `bench fleet` passes through keep their choices
TF32Attention = _WORKER["tf32_attention"].annotation
M = TypeVar("M", bound=BaseModel)
REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_url(url: str) -> str:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{url!r} is not a Redis URL: use redis://HOST:PORT/DB (or rediss://, unix://)")
    return url


def _model_preset(name: str) -> str:
    get_preset(name)  # ValueError naming the valid presets
    return name


def _ready_preset(name: str) -> str:
    return name and _model_preset(name)


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
ModelPreset = Annotated[str, AfterValidator(_model_preset)]  # a GPT-2 preset (trainer.models.presets.PRESETS)
ReadyPreset = Annotated[str, AfterValidator(_ready_preset)]  # a GPT-2 preset, or "" for none


def redis_field() -> Any:
    """A `redis_url` field's declaration: --redis-url, else the REDIS_URL variable, else the local Redis."""
    return _F(REDIS_URL, description="Redis (keys are namespaced)", json_schema_extra={"envvar": "REDIS_URL"})


def _json() -> Any:
    return _F(False, description="Print one JSON object", json_schema_extra={"name": "json"})


class IntakeBenchOptions(BaseModel):
    """`bench intake`: result intake through Redis (benchmarks.intake.run_intake_bench)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = _F(64, ge=1, description="Simulated workers (concurrent connections/threads)")
    results: int = _F(50_000, ge=1, description="Probe results to submit in total")
    batch: int = _F(4, ge=1, le=1024, description="Results per request (a task's seeds)")
    mode: Literal["http", "store", "both"] = _F("both", description="http, store or both")
    rate: float = _F(0.0, ge=0.0, description="Open-loop offered load in results/s (http); 0 = closed loop")
    redis_url: RedisUrl = redis_field()
    coordinators: int = _F(1, ge=1, le=64, description="Coordinator processes in http mode (sparecycles "
                           "coordinator --workers)")
    print_json: bool = _F(False, description="Print one JSON object per mode", json_schema_extra={"name": "json"})

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes measured, in order."""
        return ("http", "store") if self.mode == "both" else (self.mode,)


class DataPackOptions(BaseModel):
    """`bench data-pack`: tokenization throughput and the time to pack a --data folder (benchmarks.data_pack)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size_mb: float = _F(100.0, ge=0.1, description="Size of the text folder to pack, in MB (10^6 bytes)")
    model: str = _F("gpt2-tiny", description="Model preset or transformers folder whose tokenizer packs it")
    workdir: Path | None = _F(None, description="Where the temporary folder and cache go (default: $TMPDIR)")
    out: Path = _F(Path("runs/bench-data-pack/data_pack.json"), description="Result JSON to write (under runs/, "
                   f"which git ignores: {RESULTS}/ holds the committed figures)")


def _presets() -> Any:
    return _F(("gpt2-small", "gpt2-large"), min_length=1, description="comma-separated presets: gpt2-small, "
              "gpt2-medium, gpt2-large")


class KernelsBenchOptions(BaseModel):
    """`bench kernels`: the fused perturb/replay kernels against a device copy (probe_kernels.bench.run_bench)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: tuple[str, ...] = _presets()
    dist: Literal["gauss8", "rademacher"] = _F("gauss8", description="probe distribution")
    k: int = _F(40, ge=1, description="seeds per replay")
    batch: int = _F(16, ge=1, description="forward batch size (gpt2-small overhead test)")
    seq_len: int = _F(1024, ge=1, le=1024, description="forward sequence length")
    forward: bool = _F(True, description="also measure per-probe overhead vs a gpt2-small forward")
    json_out: Path | None = _F(None, description="write all measurements as JSON here")


class ProbeBenchOptions(BaseModel):
    """`bench probe`: one probe worker's speed on one GPU (probe_kernels.bench_probe.run_probe_bench)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: tuple[str, ...] = _presets()
    batch: int = _F(16, ge=1, description="probe batch size")
    seq_len: int = _F(1024, ge=1, le=1024, description="probe sequence length")
    parity_seeds: int = _F(100, ge=1, description="seeds compared with the reference path (the first preset; a "
                           "tenth of them for the others)")
    cuda_graphs: bool = _F(False, description="compile in mode reduce-overhead (CUDA graphs)")
    cross_process: bool = _F(True, description="recompute the first preset's bits in a second process")
    json_out: Path | None = _F(None, description="write all measurements as JSON here (after each preset)")


class FleetBenchOptions(BaseModel):
    """`bench fleet`: probe throughput of real workers and publish -> ready latency (benchmarks.fleet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: tuple[Annotated[int, _F(ge=1)], ...] = _F((1, 2, 4), min_length=1,
                                                      description="Comma-separated worker counts to measure")
    preset: ModelPreset = _F("gpt2-tiny", description="Model preset probed")
    seeds: int = _F(32, ge=1, description="Seeds in the timed round")
    seeds_per_task: int = _F(4, ge=1, le=256, description="Seeds per Celery task")
    batch_size: int = _F(4, ge=1, description="Rows of the probed batch")
    seq_len: int = _F(64, ge=2, description="Tokens per row of the probed batch")
    threads: int = _F(1, ge=1, description="torch threads per worker process")
    ready_preset: ReadyPreset = _F("gpt2-small", description="Preset whose publish -> ready latency is measured "
                                   "('' to skip)")
    redis_url: RedisUrl = redis_field()
    print_json: bool = _json()
    device: str = _F("cpu", description="Workers' devices, round-robin: cpu, cuda:0 or cuda:1,cuda:2")
    trainer_device: str = _F("cpu", description="Where the published model lives (cpu or cuda:N): on a GPU, "
                             "synchronous and background publishes and the training loop's cost per version are "
                             "measured")
    compare_seeds: int = _F(0, ge=0, description="Compare this many seeds of the timed round with in-process "
                            "evaluation on the first worker's device")
    interval: int = _F(20, ge=2, description="Training steps per refresh interval (trainer cost)")
    train_batch_size: int = _F(0, ge=0, description="Trainer batch (trainer cost; 0: --batch-size)")
    train_seq_len: int = _F(0, ge=0, description="Trainer sequence length (0: --seq-len)")
    json_out: Path | None = _F(None, description="Also write the JSON here, after each phase")
    blob_path: Literal["shared", "http"] = _F(
        "shared", description="How weight shards reach the workers: shared (one blob directory on this host, as "
        "under `up`) or http (loopback HTTP, as to other hosts)")
    kind: Literal["seeded", "eval"] = _F(
        "seeded", description="Timed rounds: seeded (probe rounds, fp32/TF32 on a GPU) or eval (held-out batches, "
        "one forward each: bf16 compiled on a GPU)")
    worker_cuda_graphs: bool = _F(False, description="Workers replay their compiled forwards as CUDA graphs "
                                  "(sparecycles worker --cuda-graphs)")
    tf32_attention: TF32Attention = _F(_WORKER["tf32_attention"].default, description="Workers' attention in "
                                       "fp32/TF32 forwards: auto, fp32 or bf16 (sparecycles worker --tf32-attention)")

    @model_validator(mode="after")
    def _devices_here(self) -> FleetBenchOptions:
        devices = devices_here(self.device, "--device")
        device_here(self.trainer_device, "--trainer-device")
        if self.worker_cuda_graphs and "cpu" in devices:  # as `sparecycles worker --cuda-graphs` refuses it
            raise ValueError(f"--worker-cuda-graphs needs CUDA workers (--device cuda:N), got --device {self.device}")
        return self

    @property
    def batch(self) -> tuple[int, int]:
        """(rows, tokens) of the probed batch."""
        return self.batch_size, self.seq_len

    @property
    def train_batch(self) -> tuple[int, int]:
        """(rows, tokens) of the trainer's batch: the probed batch's where unset."""
        return self.train_batch_size or self.batch_size, self.train_seq_len or self.seq_len

    @property
    def worker_args(self) -> tuple[str, ...]:
        """The extra `sparecycles worker` options these options ask for."""
        return ("--cuda-graphs",) * self.worker_cuda_graphs + ("--tf32-attention", self.tf32_attention)


class PrecisionOptions(BaseModel):
    """`bench precision`: per round kind, TF32 and bf16 forwards' signal-to-noise against fp32
    (benchmarks.precision.measure)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: ModelPreset = _F("gpt2-small", description="Model preset")
    batch_size: int = _F(16, ge=1, description="Rows per batch")
    seq_len: int = _F(512, ge=2, description="Tokens per row")
    steps: int = _F(60, ge=21, description="AdamW steps on real text before measuring")
    seeds: int = _F(8, ge=1, description="Seeds per perturbing kind and batch")
    batches: int = _F(2, ge=1, description="Validation batches scored")
    corpus: str = _F("classics-small", description="Corpus (train split trains, validation split is scored)")
    device: str = _F("cuda:0", description="Torch device (cuda:N; cpu runs every column eagerly)")
    json_out: Path | None = _F(None, description="Write the result JSON here")


def parse(model: type[M], given: dict[str, Any]) -> M:
    """`model` from a command's generated option values (trainer.cli_settings.with_settings); raises
    typer.BadParameter (exit 2) with the validators' message, naming the option."""
    from trainer.cli_settings import build

    return build(model, given)
