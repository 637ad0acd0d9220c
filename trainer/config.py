"""Typed, validated run configuration (frozen pydantic models) and run presets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer.anytime.settings import AnytimeSettings
from trainer.methods import METHODS, get_method, method_names
from wire.bounds import PROBE_EPS, KDIds, ProbeEps, RunSeed, Staleness


def _registered(name: str) -> str:
    get_method(name)  # ValueError listing the registered names
    return name


# A registered training method's name (trainer.methods.METHODS), checked wherever the field is validated (the CLI's
# --optimizer included: trainer.cli_settings).
MethodName = Annotated[str, AfterValidator(_registered)]

# Run presets: named bundles of defaults. `--preset demo` picks one of these; any other value of
# `--preset` names a model preset (trainer.models.PRESETS) and keeps the defaults below.
RUN_PRESETS: dict[str, dict] = {
    "demo": {
        "model": "gpt2-tiny",
        "corpus": "classics-small",
        "steps": 150,
        "batch_size": 16,
        "seq_len": 64,
        "lr": 3e-3,
        "warmup_steps": 15,
        "eval_every": 25,
        "eval_batches": 8,
        # Sized so two CPU probe workers finish a zocurv-line round (one probe per parameter block)
        # within one curvature interval of the trainer on a 2-core machine.
        "probe_batch_size": 4,
        "curvature_interval": 15,
    },
    # `sparecycles up --task sentiment`: MiniLM-L6 fine-tuning, pure ZO probed by the fleet vs AdamW at equal
    # steps. Sized for 2 CPU cores: on one core a probe pair of this classifier costs ~2.6 s (two full
    # Philox perturbations of 22.7M weights, ~1 s each, dominate two 16 x 48 forwards) and replaying a step
    # ~1 s per probe (trainer and every worker), so K=4 keeps a step near 11 s with two workers.
    "sentiment-demo": {
        "task": "sentiment",
        "steps": 10,
        "batch_size": 16,
        "seq_len": 48,
        "warmup_steps": 2,
        "eval_every": 5,
        "eval_batches": 8,
        "checkpoint_every": 10,
        "probes": 4,
    },
}

# `--task sentiment` fine-tunes a pretrained encoder, so the LM presets' lr would wreck it: when the
# user gives no --lr, each optimizer starts from its registered `sentiment_lr` (trainer.methods), the lr the
# sentiment benchmark picked on validation accuracy (experiments/zo/results/sentiment_summary.json; AdamW:
# measured on 30 steps at batch 16, tests/trainer/test_train_sentiment.py).


class TrainConfig(BaseModel):
    """One training run, validated when built; immutable afterwards.

    Units: lr is per optimizer step; `seq_len` and `batch_size` count tokens and sequences; the
    schedule is linear warmup over `warmup_steps` then, with `schedule` "cosine" (default), cosine from `lr`
    to `min_lr` at `steps` (the GPT-2 recipe Sophia uses: Liu et al. 2023, section 4), or with "linear", a
    straight line from `lr` to 0 at `steps` (`min_lr` unused; `lr_at`). Weights and optimizer state are fp32; on
    CUDA, matmuls run as TF32 (trainer.train.train).

    `task` picks what is trained: "lm" pretrains `model` on `corpus`, or on the user's text `data` when set
    (trainer.data.user: tokenized with the model's tokenizer, `text_field` and `encoding_errors` apply); "sentiment" fine-tunes the
    pretrained MiniLM-L6 encoder with a 2-way head (trainer.sentiment) and ignores `model` and
    `corpus`; there `seq_len` is the max tokens per sentence and evaluation uses a fixed random subset of
    `eval_batches * batch_size` validation sentences. ZO-Curv optimizers are LM-only; the pure-ZO ones run
    in process or over the fleet (`sparecycles up --task sentiment`).

    Raises:
        pydantic.ValidationError: on unknown fields, out-of-range values or inconsistent settings.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field("gpt2-tiny", min_length=1, description="model preset (trainer.models.PRESETS) or a local "
                       "transformers folder")
    corpus: str = Field("classics-small", min_length=1, description="corpus: classics-small, classics or "
                        "classics-large (with a selection split)")
    # The user's own text (trainer.data.user): set, the LM task trains on it instead of `corpus`.
    data: str | None = Field(None, min_length=1, description=(
        "your text instead of --corpus: a file, folder or glob of .txt, .jsonl/.json, .parquet or a datasets "
        "save_to_disk folder (or a folder `sparecycles data pack` wrote), tokenized with the model's tokenizer"))
    text_field: str = Field("text", min_length=1, description="--data: the JSON field / parquet column of the text")
    encoding_errors: Literal["strict", "replace"] = Field(
        "strict", description="--data: invalid UTF-8 is refused (strict) or read as U+FFFD (replace)")
    optimizer: MethodName = Field("adamw", description=f"training method (trainer/methods.py): {', '.join(METHODS)}")
    steps: int = Field(300, ge=1, le=10_000_000, description="optimizer steps")
    batch_size: int = Field(16, ge=1, le=4096, description="sequences per step")
    seq_len: int = Field(128, ge=2, le=8192, description="tokens per sequence")
    lr: float = Field(3e-3, gt=0, le=1.0, description="peak learning rate")
    min_lr: float = Field(1e-5, ge=0, le=1.0, description="cosine schedule: the final learning rate")
    warmup_steps: int = Field(30, ge=0, description="linear warmup steps (a preset's scales down with a "
                              "shorter --steps)")
    schedule: Literal["cosine", "linear"] = Field("cosine", description="decay after warmup: cosine (to min_lr) "
                                                  "or linear (to zero)")
    weight_decay: float = Field(0.1, ge=0, le=10.0, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    grad_clip: float = Field(1.0, ge=0, description="gradient norm clip (0: none)")
    eval_every: int = Field(50, ge=1, description="evaluate every N steps")
    eval_batches: int = Field(8, ge=1, le=10_000, description="held-out batches per evaluation (capped at "
                              "the validation split)")
    checkpoint_every: int = Field(100, ge=1, description="checkpoint every N steps")
    seed: RunSeed = Field(0, description="run seed (init, batches, probe seeds)")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    run_dir: Path | None = Field(None, description="run folder (default runs/<model>-<corpus>-<optimizer>-s<seed>)")
    # Knobs of the ZO modes (ignored by adamw); names follow DESIGN section 2.
    probes: int = Field(8, ge=1, le=100_000, description="ZO: K probes per step / per curvature round")
    eps: ProbeEps = Field(PROBE_EPS, description="ZO: probe step epsilon (role variants: relative to a group's RMS)")
    alpha: float = Field(0.1, ge=0, le=2.0, description="1.5-SPSA curvature exponent")
    lam: float = Field(1.0, gt=0, description="1.5-SPSA weight floor lambda")
    probe_batch_size: int = Field(16, ge=1, le=4096, description="ZO: sequences per probe batch")
    curvature_interval: int = Field(10, ge=1, description="ZO-Curv: steps between curvature rounds")
    staleness: Staleness = Field(2, description="ZO-Curv: staleness bound S, in versions (`up` sets 2 x "
                             "curvature-interval unless given: a fleet round's round trip)")
    probe_budget: int = Field(41, ge=3, le=1_000_000,
                              description="zocurv-group: forward-equivalents per curvature refresh")
    task: Literal["lm", "sentiment"] = Field("lm", description="lm (pretraining on the corpus or --data) or "
                                             "sentiment (MiniLM-L6 fine-tuning)")
    # The method's own knobs (trainer.methods.Method.options), validated against it; {} keeps its defaults.
    optimizer_options: dict[str, float | int | str | bool | None] = Field(
        default_factory=dict, description="a knob of the chosen optimizer, e.g. s_max=8 for zocurv-line")
    # The anytime model (trainer.anytime): None = off. LM task only; needs a corpus with a
    # selection split (checked when the corpus is loaded).
    anytime: AnytimeSettings | None = Field(None, description="the anytime model (served_val_loss, "
                                            "RUN_DIR/served.safetensors, `export --best`)")

    # Distillation (trainer.kd): None = off. In process for now (the teacher on the trainer's device).
    teacher: str | None = Field(None, min_length=1, description="distillation teacher: smollm2-135m or a "
                                "transformers folder with the student's tokenizer (loss (1-a) CE + a KD)")
    kd_alpha: float = Field(0.5, ge=0, le=1.0, description="--teacher: KD weight a in (1-a) CE + a KD")
    kd_estimator: Literal["full", "sampled", "topk"] = Field(
        "sampled", description="--teacher: full-vocabulary KL, S ids sampled from the teacher, or its top-k")
    kd_k: KDIds = Field(16, description="--teacher: S (sampled) or k (topk) ids per position")
    kd_temperature: float = Field(1.0, gt=0, le=100.0, description="--teacher: distillation temperature")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be smaller than --steps ({self.steps})")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.data is not None and self.task != "lm":
            raise ValueError("--data (your text) is for the LM task (--task lm)")
        given = [f"--{n.replace('_', '-')}" for n, default in (("text_field", "text"), ("encoding_errors", "strict"))
                 if getattr(self, n) != default]
        if given and self.data is None:  # they say how --data is read: without it they would be ignored
            one = len(given) == 1
            raise ValueError(f"{' and '.join(given)} {'says' if one else 'say'} how --data is read: "
                             f"{'it needs' if one else 'they need'} --data")
        if self.anytime is not None and self.task != "lm":
            raise ValueError("the anytime model (--anytime) runs on the LM task (--task lm)")
        method = get_method(self.optimizer)
        if self.task not in method.tasks:
            # ZO-Curv estimates curvature for pretraining-scale backprop runs (DESIGN section 2); the
            # sentiment task compares the pure-ZO methods, so it is not wired or tested there.
            why = "; ZO-Curv variants run on the LM task (--task lm)" if method.kind == "zo-curv" else ""
            raise ValueError(f"--task {self.task} supports {', '.join(method_names(task=self.task))}, "
                             f"not {self.optimizer!r}{why}")
        try:
            method.parse_options(self.optimizer_options)
        except ValidationError as exc:
            bad = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
            knobs = ", ".join(method.options.model_fields) or "none"
            raise ValueError(f"optimizer_options of {self.optimizer}: {bad} (its knobs: {knobs})") from None
        return self

    def run_json(self) -> dict:
        """The run's identity as compared on --resume: every field but `run_dir` and `steps` (a run may be extended
        or shortened: config.json records `steps` beside it, trainer.run_dir, and the resume says how that changes
        the lr schedule, `replan_note`), `optimizer_options` / `anytime` only when set, `schedule` only
        when not "cosine", `data`/`text_field`/`encoding_errors` only with `data` and the kd_* fields only with
        `teacher` (folders from before those fields existed still resume); `corpus` only without `data` (the run
        does not read it: `recorded_run` drops it from an older folder's config.json)."""
        exclude = {"run_dir", "steps"} | (set() if self.optimizer_options else {"optimizer_options"})
        exclude |= set() if self.schedule != "cosine" else {"schedule"}
        exclude |= set() if self.anytime is not None else {"anytime"}
        exclude |= {"corpus"} if self.data is not None else {"data", "text_field", "encoding_errors"}
        exclude |= set() if self.teacher is not None else {"teacher", "kd_alpha", "kd_estimator", "kd_k",
                                                           "kd_temperature"}
        return self.model_dump(mode="json", exclude=exclude)


def recorded_run(old: dict) -> dict:
    """A config.json as `TrainConfig.run_json` writes it now: an older folder's `corpus` beside `data` dropped (the
    run trained on `data`), so such a folder still resumes and is still recognised."""
    return {k: v for k, v in old.items() if not (k == "corpus" and old.get("data") is not None)}


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine") -> float:
    """Learning rate at 0-based `step`: linear warmup to `lr`, then the decay `schedule`.

    "cosine": cosine from `lr` to `min_lr` at `total_steps`, the schedule of GPT-2 pretraining recipes
    (nanoGPT; Sophia, Liu et al. 2023). "linear": lr·(1 − p) with p the post-warmup progress, reaching 0 at
    `total_steps` (`min_lr` ignored): linear decay to zero, which Bergsma et al. ("Straight to Zero: Why
    Linearly Decaying the Learning Rate to Zero Works Best for LLMs", ICLR 2025) found beats cosine to 10%
    for AdamW at compute-optimal budgets. The last step (p = (T−1−w)/(T−w)) keeps a small positive lr.
    Pure function. Raises ValueError for another schedule.
    """
    if schedule not in ("cosine", "linear"):
        raise ValueError(f"schedule must be 'cosine' or 'linear', got {schedule!r}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return lr * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def replan_note(cfg: TrainConfig, *, planned_steps: int | None, at_step: int) -> str | None:
    """The console line of a resume whose --steps differs from the `planned_steps` the run's schedule was built for
    (config.json's `steps`): the decay after warmup spans `cfg.steps` from now on, so the lr of the next step
    changes (`at_step`: the checkpoint's completed steps, the 0-based index of that step); the line gives it
    under both plans (`lr_at`; past its end the old plan's lr is min_lr, or 0 for linear) and the
    --steps that keeps the old one. The trainer has no schedule meant for extension (no constant stage), so the
    re-planned decay is the only way to extend a run. None when nothing changes: `planned_steps` None (a fresh run,
    or a folder from before steps were recorded) or equal to `cfg.steps`, no step left to run, or the next step's lr
    the same under both plans (a resume inside warmup: the line would read "lr x -> x")."""
    if planned_steps is None or planned_steps == cfg.steps or at_step >= cfg.steps:
        return None
    kw = dict(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule)
    before = lr_at(at_step, total_steps=planned_steps, **kw)
    after = lr_at(at_step, total_steps=cfg.steps, **kw)
    if before == after:
        return None
    return (f"resuming after step {at_step} with --steps {cfg.steps}: lr {before:.2e} -> {after:.2e}, the "
            f"{cfg.schedule} decay built for {planned_steps} steps is re-planned over {cfg.steps} (--steps "
            f"{planned_steps} keeps the old schedule)")


def resolve_preset(preset: str, overrides: dict, *, recorded_warmup: int | None = None) -> TrainConfig:
    """Build a TrainConfig from a run preset name (e.g. "demo") or a model preset name plus overrides.

    Overrides whose value is None are ignored (CLI options left unset): a setting is the user's when it is among
    `overrides` with a value, the one rule every derived default below follows. `warmup_steps` the user did not
    set is derived from --steps (a preset's scales down with a shorter run), or with `recorded_warmup` (a
    --resume: the warmup the run's config.json records) is that one: the run keeps the warmup it started with
    when --steps changes, where the derived one would move with it and make the resume another run.
    Raises ValueError if `preset` is neither a run preset nor a model preset (`--task sentiment` ignores the
    model, so a typo would otherwise run silently with the LM defaults).
    """
    if preset not in RUN_PRESETS:
        from trainer.models.presets import PRESETS

        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; run presets: {', '.join(RUN_PRESETS)}; "
                             f"model presets: {', '.join(PRESETS)}")
    base: dict = dict(RUN_PRESETS.get(preset, {"model": preset}))
    given = {k: v for k, v in overrides.items() if v is not None}
    base.update(given)
    if base.get("task") == "sentiment" and "lr" not in given:
        method = METHODS.get(base.get("optimizer", "adamw"))  # an unknown name fails in TrainConfig below
        base["lr"] = (method and method.sentiment_lr) or base.get("lr", 3e-3)
        base.setdefault("min_lr", base["lr"] / 10)
        base["min_lr"] = min(base["min_lr"], base["lr"])
    # A preset's warmup scales down with a shorter --steps unless the user set --warmup-steps.
    # (A model preset sets neither: TrainConfig's defaults apply, so compare those.)
    default = TrainConfig.model_fields
    warmup = base.get("warmup_steps", default["warmup_steps"].default)
    if "warmup_steps" not in given and warmup >= base.get("steps", default["steps"].default):
        base["warmup_steps"] = base["steps"] // 10
    if "warmup_steps" not in given and recorded_warmup is not None:
        base["warmup_steps"] = recorded_warmup
    return TrainConfig(**base)
