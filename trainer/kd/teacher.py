"""An in-process teacher: a frozen causal LM whose targets make the student's loss (1 - alpha) CE + alpha KD.

`KDLoss(model, batch)` is a drop-in `loss_fn` (trainer.modes): it runs the teacher on x under no_grad, turns its
logits into targets (`full`: the logits themselves; `sampled` / `topk`: trainer.kd.targets.make_targets, seeded by
(seed, batch_key(x), rank): the same batch, the same ids) and mixes trainer.kd.estimators' KD term with the
student's CE. The fleet path (teacher rounds on workers: fleet/teacher.py, probe_worker/teacher.py) uses the same counter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from trainer.data.model_tokenizer import TokenizerError, tokenizer_for
from trainer.kd.estimators import full_kl, kd_loss, sparse_ce
from trainer.kd.targets import make_targets
from trainer.methods import get_method

Estimator = Literal["full", "sampled", "topk"]
TEACHER_PRESETS = ("smollm2-135m",)


class TeacherMismatchError(ValueError):
    """Teacher and student do not share a tokenizer (or the teacher folder cannot be a teacher)."""


def teacher_folder(teacher: str) -> Path:
    """The transformers folder of `teacher`: the preset 'smollm2-135m' (trainer.models.pretrained.smollm2_dir)
    or a local folder holding config.json and weights. Raises TeacherMismatchError otherwise."""
    if teacher in TEACHER_PRESETS:
        from trainer.models.pretrained import smollm2_dir

        return smollm2_dir()
    path = Path(teacher).expanduser()
    if not (path / "config.json").is_file():
        raise TeacherMismatchError(f"--teacher {teacher!r}: neither a preset ({', '.join(TEACHER_PRESETS)}) nor "
                                   "a transformers folder with config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TeacherMismatchError(f"--teacher {teacher!r}: the folder holds no weights (*.safetensors / *.bin)")
    return path.resolve()


# Texts both tokenizers must encode alike when their files differ (one BPE saved two ways: tiktoken's ranks and the
# transformers tokenizer.json that trainer.export writes from them): ASCII, digits, whitespace runs, accents, CJK.
TOKENIZER_PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "  indented\n\n\tlines 1234567 3.14",
                         "café naïve Straße — “quoted” ‘text’", "日本語のテキスト and 中文", "<|endoftext|> as text")
# The texts a serving engine's /tokenize is checked on (probe_worker.engine_teacher): all but special-token markup,
# which an engine's API parses as the special id while the training data's tokenizer reads it as text.
ENGINE_PROBE_TEXTS = tuple(t for t in TOKENIZER_PROBE_TEXTS if "<|" not in t)


def check_tokenizers(student: str, teacher: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's, naming both. The same when their
    trainer.data.tokenizer_for sha256 and vocabulary size match, or when the files differ but vocabulary, end-of-text
    id and the ids of TOKENIZER_PROBE_TEXTS all match (a GPT-2 preset student, a teacher exported by trainer.export).
    Raises TeacherMismatchError (also for a teacher folder without tokenizer files)."""
    s = tokenizer_for(student)
    try:
        t = tokenizer_for(str(teacher_folder(teacher)))
    except TokenizerError as exc:
        raise TeacherMismatchError(f"--teacher: {exc}") from None
    if (s.sha256, s.vocab_size) == (t.sha256, t.vocab_size):
        return
    texts = list(TOKENIZER_PROBE_TEXTS)
    if (s.vocab_size, s.eos_id) != (t.vocab_size, t.eos_id) or s.encode_batch(texts) != t.encode_batch(texts):
        raise TeacherMismatchError(f"teacher tokenizer {t.name} (vocab {t.vocab_size}) differs from the student's "
                                   f"{s.name} (vocab {s.vocab_size}): distillation needs the same tokenizer")


def check_teacher_run(cfg, *, fleet: bool) -> None:
    """Refuse a `--teacher` run that cannot distil, before anything starts: another task than lm, a pure-ZO method
    whose update is made of fleet probes (`fleet`: a coordinator's workers probe the run; they evaluate the CE loss
    and never see the teacher's targets, so the teacher would not reach the update), or tokenizers that differ
    (check_tokenizers). A ZO-Curv run on the fleet is allowed: its probes size the steps of (1-a) CE + a KD for the
    CE loss the run is judged by. cfg: trainer.config.TrainConfig. Raises TeacherMismatchError."""
    if cfg.teacher is None:
        return
    kind = get_method(cfg.optimizer).kind
    if cfg.task != "lm" or (fleet and kind == "pure-zo"):
        raise TeacherMismatchError(f"--teacher needs the lm task and, with fleet probes, a method whose update is "
                                   f"not made of them (task {cfg.task!r}, {cfg.optimizer} is {kind}, fleet probes "
                                   f"{fleet}): fleet probe workers evaluate the CE loss and never see the teacher's "
                                   "targets; use adamw or a zocurv-* method, or probe in process")
    check_tokenizers(cfg.model, cfg.teacher)


def load_teacher(teacher: str, device: str) -> torch.nn.Module:
    """The teacher, frozen, in eval mode: bf16 on CUDA, fp32 on CPU (AutoModelForCausalLM, local files only)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(teacher_folder(teacher), dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False)


def teacher_files(teacher: str) -> list[Path]:
    """The files that make the teacher `teacher` (teacher_folder): config.json and its weight files (*.safetensors,
    *.bin), in name order; what teacher_sha256 hashes and fleet.teacher_weights publishes. Raises
    TeacherMismatchError as teacher_folder does."""
    folder = teacher_folder(teacher)
    return sorted([folder / "config.json", *folder.glob("*.safetensors"), *folder.glob("*.bin")])


def teacher_sha256(teacher: str) -> str:
    """sha256 (hex) of the teacher folder's config.json and weight files (*.safetensors, *.bin), in name order,
    each as its name, its byte length and its bytes: the identity a fleet teacher round names and a worker checks
    before it loads the folder. Raises TeacherMismatchError as teacher_folder does."""
    h = hashlib.sha256()
    for f in teacher_files(teacher):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def batch_key(x: torch.Tensor) -> int:
    """The target counter of a batch: the first 8 bytes of sha256 over its int64 token ids (B, T), so the same
    batch always gets the same sampled ids (a ZO method's +/- probes of one step see one target set) and
    micro-batches get their own."""
    return int.from_bytes(hashlib.sha256(x.detach().to(torch.int64).cpu().numpy().tobytes()).digest()[:8], "little")


class KDLoss:
    """loss_fn(model, (x, y)) -> (1 - alpha) * CE + alpha * KD, x, y int64 (B, T); a float32 scalar (nats/token).

    Holds the teacher and a call counter; `last` keeps the latest (ce, kd) floats
    for metrics. Teacher and student must share the vocabulary (checked per call: ValueError naming both).
    """

    def __init__(self, teacher: torch.nn.Module, *, alpha: float, estimator: Estimator, k: int,
                 temperature: float, seed: int, rank: int = 0) -> None:
        self.teacher, self.alpha, self.estimator, self.k = teacher, alpha, estimator, k
        self.temperature, self.seed, self.rank, self.calls = temperature, seed, rank, 0
        self.last: tuple[float, float] = (float("nan"), float("nan"))

    def __call__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(input_ids=x).logits  # (B, T, V)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        with torch.no_grad():
            z = self.teacher(input_ids=x).logits
        if z.shape[-1] != logits.shape[-1]:
            raise ValueError(f"teacher vocabulary {z.shape[-1]} != student vocabulary {logits.shape[-1]}")
        if self.estimator == "full":
            kd = full_kl(logits, z, self.temperature)
        else:
            tg = make_targets(z, kind=self.estimator, k=self.k, temperature=self.temperature,
                              seed=self.seed, step=batch_key(x), rank=self.rank)
            kd = sparse_ce(logits, tg)
        self.calls += 1
        self.last = (float(ce.detach()), float(kd.detach()))
        return kd_loss(ce, kd, self.alpha)
