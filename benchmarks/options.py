"""The options of `sparecycles bench fleet`, `bench zo`, `bench precision`, `bench regime run`, ..., as typed models.

Each command's options are generated from these fields by trainer.cli_settings (as `train`'s from TrainConfig): one
declaration per option, with its default, bounds and help (the description); "name" in json_schema_extra spells an
option otherwise than its field (`print_json` is `--json`), "envvar" reads a variable when the option is not given.
The run functions take the model (benchmarks.fleet.run_fleet_bench) or the small specs built from it
(benchmarks.zo.SentimentSpec / LmSpec, benchmarks.zo_paper.PaperCall). `parse(model, given)` builds one from a
command's values and turns a refusal into typer.BadParameter (exit 2) naming the option; the rules between options
are model validators (testable without the CLI). Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from benchmarks.regime import PLANS
from fleet.devices import device_here, devices_here
from probe_worker.options import WorkerOptions
from trainer.config import TrainConfig
from trainer.models.presets import get_preset
from trainer.run_options import RunOptions

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
                   "which git ignores: benchmarks/results/ holds the committed figures)")


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


class HeadlineReportOptions(BaseModel):
    """`bench headline report`: the pretraining report of finished runs (benchmarks.headline.pretrain_report)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path = _F(Path("runs/headline"), description="folder for pretrain_summary.json and pretrain_val_loss.png")


class MemoryScanOptions(BaseModel):
    """`bench headline memory`: the largest GPT shape that trains in place on one GPU (benchmarks.headline)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = _F("cuda", description="CUDA device")
    shapes: tuple[str, ...] = _F(("gpt2-xl", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-30b", "gpt-45b"), min_length=1,
                                 description="comma-separated shapes, ascending (benchmarks.headline.SCAN_SHAPES)")
    seq_len: int = _F(1024, ge=1, le=1024, description="tokens per sequence (batch 1)")
    json_out: Path | None = _F(None, description="write the scan as JSON here")


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


class ZoBenchOptions(BaseModel):
    """`bench zo`: the ZO side-by-side benchmarks (benchmarks.zo; --regime paper: benchmarks.zo_paper)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    part: Literal["lm", "sentiment", "all"] = _F(
        "all", description="lm (gpt2-tiny: AdamW vs ZO-Curv), sentiment (MeZO/1SPSA/1.5-SPSA) or all")
    out: Path = _F(Path("runs/zo-bench"), description="Folder for JSON summaries, PNG figures and run folders")
    device: str = _F("cpu", description="cpu or cuda[:N]")
    steps: int = _F(600, ge=1, description="lm: optimizer steps per run")
    probes: int = _F(32, ge=1, description="lm: block-scaled probes per curvature round")
    k: int = _F(16, ge=1, description="sentiment: probes K per step of 1SPSA and 1.5-SPSA")
    budget: int = _F(6000, ge=3, description="sentiment: forward passes per run")
    lrs: str = _F("1e-5,1e-4,1e-3", description="sentiment: comma-separated learning rates tried per method")
    seed: int = _F(0, ge=0, description="Run seed")
    methods: str = _F("mezo,1spsa,1.5spsa", description="sentiment: comma-separated ZO methods to sweep")
    model: Literal["minilm", "smollm2"] = _F(
        "minilm", description="sentiment: minilm (MiniLM-L6 + new head) or smollm2 (SmolLM2-135M-Instruct as a "
        "prompt + label-word classifier, all parameters)")
    head_init: str | None = _F(None, description="sentiment: classifier start; minilm: random (BERT init, default) "
                               "or linear-probe (logistic regression on frozen features first: LP-FT); smollm2: "
                               "prompt (the zero-shot prompt classifier, its only start)")
    evals: int = _F(10, ge=1, description="sentiment: accuracy evaluations per run")
    backprop_steps: int = _F(0, ge=0, description="sentiment: also run the backprop AdamW baseline this many steps")
    backprop_lr: float | None = _F(None, ge=0.0, description="sentiment: AdamW lr of the baseline (default 5e-5 "
                                   "minilm, 1e-5 smollm2)")
    regime: Literal["project", "paper"] = _F(
        "project", description="sentiment: project (the sweep above) or paper (smollm2 only: 1.5-SPSA's published "
        "regime, arms A1..A6 of issue 18; benchmarks.zo_paper)")
    arms: str = _F("", description="regime paper: comma-separated arms (A1,A2,A3,A3w,A4-16,A4-128,A5-1e-05,"
                   "A5-3e-05,A6-1e-05,A6-5e-05); empty = all. The time budget is shared by these only")
    time_budget: float = _F(300.0, ge=1.0, description="regime paper: seconds shared by the arms run now (each "
                            "stops at its share or its iteration cap)")
    fp32_matmul: str = _F("highest", description="regime paper, CUDA: fp32 arms' matmuls, highest (true fp32) or "
                          "high (TF32: ~2x faster, but its rounding swamps h at eps 1e-4); per arm: e.g. "
                          "high,A1=highest,A3=highest (a bare mode is the default)")
    include: Path | None = _F(None, description="regime paper: an earlier call's paper_summary.json to merge: its "
                              "arms are kept unless re-run; its A1 gives A3w's lr and the drift's ledger")
    resume: bool = _F(False, description="regime paper: an arm named in --arms that stopped on time in the "
                      "--include summary continues from its last iteration (its step ledger replayed) instead of "
                      "restarting; one that finished there is kept")
    shares: str = _F("", description="regime paper: share weights overriding the defaults (A1 24, A2 16, A3 11, "
                     "A3w 11, A4-16 5, A4-128 8, A5-* 5, A6-* 3), e.g. A1=70,A3=24; renormalised")
    drift: bool = _F(True, description="regime paper: measure the bf16 in-place drift on A1's ledger (once per "
                     "ledger, after the arms; ~10 s on a GPU at 75 iterations)")
    iters_cap: int | None = _F(None, ge=1, description="regime paper: cap every arm's iterations (smoke tests)")
    end_by: float | None = _F(None, description="regime paper: wall-clock deadline (unix seconds, e.g. "
                              "$(( $(date +%s) + 540 ))): the arms' budget shrinks so the run ends by then")

    @model_validator(mode="after")
    def _paper_options(self) -> ZoBenchOptions:
        if self.regime == "paper" and self.model != "smollm2":
            raise ValueError(f"--model: --regime paper runs on smollm2 only, got {self.model!r}")
        if self.resume and self.include is None:
            raise ValueError("--resume continues arms of an --include summary: give --include")
        return self

    @property
    def arm_names(self) -> tuple[str, ...] | None:
        """--arms as a tuple (None: every arm)."""
        return tuple(a.strip() for a in self.arms.split(",") if a.strip()) or None


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


def _override(model: type[BaseModel], name: str) -> Any:
    """`model`'s field `name` as an optional override of it: its type and bounds (declared there once), or None."""
    info = model.model_fields[name]
    return Annotated[(info.annotation | None, *info.metadata)]


_BatchSize, _SeqLen = _override(TrainConfig, "batch_size"), _override(TrainConfig, "seq_len")
_Corpus, _Model = _override(TrainConfig, "corpus"), _override(TrainConfig, "model")
_MicroBatchSize = _override(RunOptions, "micro_batch_size")
PlanName = Literal[tuple(PLANS)]  # benchmarks.regime.PLANS' names: a plan added there is a choice here


class RegimeRunOptions(BaseModel):
    """`bench regime run`: issue 29's resumable plan (benchmarks.regime.run_plan). The overrides of the plan's run
    settings take TrainConfig's (and RunOptions') bounds; unset, the plan's own settings stand."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: PlanName = _F(description="the plan: full (64x1024), h200, h200b, h200c, h200d (one-GPU calls) or cpu "
                        "(a tiny dry run); benchmarks.regime.PLANS")
    out: Path = _F(description="folder of the run folders (resumable: finished runs are kept)")
    jobs: int = _F(4, ge=1, le=256, description="runs at a time (one process each)")
    devices: str = _F("auto", min_length=1, description="comma-separated devices, runs spread round-robin; auto: "
                      "cuda when torch sees a GPU, else cpu")
    deadline_s: float = _F(440.0, gt=0.0, allow_inf_nan=False, description="seconds after which the runs still "
                           "going are stopped (checkpointed) and no other starts")
    batch_size: _BatchSize = _F(None, description="override the plan's sequences per step")
    seq_len: _SeqLen = _F(None, description="override the plan's tokens per sequence")
    corpus: _Corpus = _F(None, description="override the plan's corpus")
    model: _Model = _F(None, description="override the plan's model preset")
    micro_batch_size: _MicroBatchSize = _F(None, description="sequences per forward/backward: each step's gradients "
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


def parse(model: type[M], given: dict[str, Any]) -> M:
    """`model` from a command's generated option values (trainer.cli_settings.with_settings); raises
    typer.BadParameter (exit 2) with the validators' message, naming the option."""
    from trainer.cli_settings import build

    return build(model, given)
