"""Export trained models as standard transformers folders (`from_pretrained`-loadable, offline).

A folder holds `config.json`, `model.safetensors` (fp32, as trained; tied weights once), the tokenizer
(`tokenizer.json` + `tokenizer_config.json`), `generation_config.json` for causal LMs, and
`sparecycles.json` (where it came from: run folder, step, run config, final metrics).

- GPT-2 presets -> `GPT2LMHeadModel`. The project tokenizes with GPT-2 BPE from a tiktoken rank file
  (trainer.data.tokenizer); `gpt2_tokenizer` converts those ranks with transformers' `TikTokenConverter`
  (vocab = the 50,257 ranks as byte-level strings, merges = every split of a token into two tokens,
  ordered by the merged token's rank) under the GPT-2 pre-tokenisation regex, so it encodes text to the
  same ids as `gpt2_encoding()` (tests/trainer/test_export.py checks a slice of the corpus). `<|endoftext|>` = 50256
  is BOS, EOS and UNK, as in GPT-2; `model_max_length` is the preset's context.
- The MiniLM sentiment classifier -> `BertForSequenceClassification` with its trained head, labels
  0 = negative, 1 = positive; its tokenizer's `model_max_length` is the run's `seq_len`, the length it was
  trained and scored at, so `tokenizer(texts, truncation=True)` feeds the model what the run did.
- SmolLM2 (`LlamaForCausalLM`, or the `PromptClassifier` the ZO sentiment benchmark trains around it) ->
  `LlamaForCausalLM` with the tokenizer it was loaded with (`export_model`); a prompt classifier's template
  and label words go to `sparecycles.json`.

`export_run(run_dir, out_dir)` rebuilds a run folder's model from `checkpoint.safetensors` (model tensors
only); `train()` calls `export_trained` on the in-memory model at the end of a run (`RUN_DIR/export/`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trainer.models import build_model, load_minilm_classifier
from trainer.models.causal_lm import build_causal_lm, context_of, is_preset
from trainer.paths import cache_dir
from trainer.run_dir import not_a_run_folder

CHECKPOINT_NAME = "checkpoint.safetensors"
SENTIMENT_LABELS = {0: "negative", 1: "positive"}  # trainer.data.sentiment: label 1 = positive


class ExportError(RuntimeError):
    """A run folder cannot be exported: missing, not a run, no checkpoint, unfinished, or unknown model."""


def gpt2_tokenizer_file() -> Path:
    """`tokenizer.json` of the GPT-2 BPE converted from the project's rank file, cached under
    `cache_dir()/tokenizers/` (named by the ranks' sha256; the conversion takes seconds, a load ~0.3 s).

    Raises:
        trainer.data.sources.DataFetchError: the rank file is not cached and cannot be fetched.
    """
    from trainer.data.tokenizer import RANKS_SHA256

    path = cache_dir() / "tokenizers" / f"gpt2-transformers-{RANKS_SHA256[:16]}.json"
    if not path.is_file():
        from transformers.convert_slow_tokenizer import TikTokenConverter

        from trainer.data.tokenizer import EOT, GPT2_PATTERN, gpt2_ranks_path

        backend = TikTokenConverter(vocab_file=gpt2_ranks_path(), pattern=GPT2_PATTERN,
                                    extra_special_tokens={"<|endoftext|>": EOT}).converted()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent conversion writes identical content
    return path


def gpt2_tokenizer(model_max_length: int = 1024):
    """The project's GPT-2 BPE (trainer.data.tokenizer.gpt2_encoding) as a transformers fast tokenizer.

    `gpt2_tokenizer()("Hello world")["input_ids"] == [15496, 995]`; vocabulary 50,257 with `<|endoftext|>`
    = 50256 as BOS/EOS/UNK and no padding token (GPT-2 has none). No special tokens are added on encode.

    Raises:
        trainer.data.sources.DataFetchError: the rank file's source (the openai-whisper sdist) is not cached
            and cannot be fetched.
    """
    from transformers import GPT2TokenizerFast

    eot = "<|endoftext|>"
    return GPT2TokenizerFast(tokenizer_file=str(gpt2_tokenizer_file()), bos_token=eot, eos_token=eot,
                             unk_token=eot, model_max_length=model_max_length)


EXPORT_INFO = "sparecycles.json"  # every export writes it (export_model); a run folder never does
_RUN_FILES = (CHECKPOINT_NAME, "metrics.jsonl")  # trainer.run_dir: what makes a folder a run's


def _is_within(path: Path, folder: Path) -> bool:
    """`path` is `folder` or inside it (both resolved)."""
    return path == folder or folder in path.parents


def not_an_export(folder: Path) -> str | None:
    """Why `folder` is not an export this module wrote (None when it is): an export holds `sparecycles.json`,
    `config.json` and the weights (`model.safetensors`, or its `.index.json` when sharded), no run files
    (checkpoint.safetensors, metrics.jsonl) and no subfolders (save_pretrained writes a flat folder, so a folder
    with folders in it holds more than an export)."""
    names = {p.name for p in folder.iterdir()}
    run_files = sorted(names & set(_RUN_FILES))
    if run_files:
        return f"it holds a run ({', '.join(run_files)})"
    missing = [n for n in (EXPORT_INFO, "config.json") if n not in names]
    if not names & {"model.safetensors", "model.safetensors.index.json"}:
        missing.append("model.safetensors")
    if missing:
        return f"it has no {', '.join(missing)}"
    subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if subfolders:
        return f"it holds folders ({', '.join(subfolders[:3])}), which an export never does"
    return None


def out_dir_refusal(out_dir: Path, *, overwrite: bool, run_dir: Path | None = None) -> str | None:
    """Why an export may not be written to `out_dir` (None when it may), one line fit for a user. Nothing is
    touched; `export_run` asks before building the model, `_write_folder` again before it writes.

    A missing or empty `out_dir` is fine. A non-empty one needs `overwrite`, and `overwrite` replaces only an
    earlier export (`not_an_export`): never the run folder `run_dir`, a folder holding it or inside it, the current
    folder or one above it, the filesystem root or the home folder (or one above it), nor a link.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder; pass another output folder"
    here, target = Path.cwd().resolve(), out.resolve()
    if run_dir is not None:
        run = Path(run_dir).resolve()
        if target == run:
            return (f"OUT_DIR {out} is the run folder itself; export to a new folder, e.g. "
                    f"`sparecycles export {run_dir} {Path(run_dir).name}-hf`")
        if run in target.parents:
            if out.is_dir() and any(out.iterdir()):
                return (f"OUT_DIR {out} is a non-empty folder inside the run folder {run_dir}; nothing was "
                        "deleted; export to a new folder outside it")
        elif _is_within(run, target):
            return (f"OUT_DIR {out} holds the run folder {run_dir}; nothing was deleted; export to a new folder, "
                    f"e.g. `sparecycles export {run_dir} {Path(run_dir).name}-hf`")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if not overwrite:
        return (f"{out} is not empty; pass another output folder, or --overwrite to replace an earlier export "
                "there")
    home = Path.home().resolve()
    if target == Path(target.anchor) or _is_within(home, target):
        return f"--overwrite refused: {out} is the filesystem root or your home folder; nothing was deleted"
    if _is_within(here, target):
        return (f"--overwrite refused: {out} is the current folder or one above it; nothing was deleted; pass "
                "a new output folder")
    if out.is_symlink():
        return f"--overwrite refused: {out} is a link; nothing was deleted; pass the folder it points to"
    why = not_an_export(out)
    if why is not None:
        return (f"--overwrite refused: {out} is not an earlier export ({why}); --overwrite replaces only a "
                "folder `sparecycles export` wrote; nothing was deleted; pass a new or empty output folder")
    return None


def _write_folder(out_dir: Path, write, overwrite: bool) -> Path:
    """Run write(tmp) in a fresh sibling folder, then swap it in for `out_dir` (readers never see half a folder).

    An earlier export at `out_dir` is renamed aside, the new one renamed in, then the old one removed: a failed
    write, or a failed rename, leaves the earlier export as it was.

    Raises FileExistsError (`out_dir_refusal`'s line) when `out_dir` may not be written; nothing is touched.
    """
    out_dir = Path(out_dir)
    why = out_dir_refusal(out_dir, overwrite=overwrite)
    if why is not None:
        raise FileExistsError(why)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    old: Path | None = None
    try:
        write(tmp)
        tmp.chmod(0o755)
        if out_dir.exists():  # an earlier export (or an empty folder): set aside until the new one is in place
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-old-"))
            os.replace(out_dir, old)  # replaces the empty placeholder mkdtemp made
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if old is not None:
                os.replace(old, out_dir)
                old = None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_model(model: torch.nn.Module, out_dir: Path, *, tokenizer, info: dict[str, Any] | None = None,
                 overwrite: bool = False) -> Path:
    """Write `model` and `tokenizer` as a transformers folder at `out_dir` and return it.

    Args:
        model: a transformers `PreTrainedModel` (GPT2LMHeadModel, LlamaForCausalLM,
            BertForSequenceClassification, ...) on any device, or a trainer.prompt_classifier.PromptClassifier
            (its LM is exported; template and label words go to sparecycles.json). Saved in its own dtype.
        tokenizer: the tokenizer to save beside it (any transformers tokenizer).
        info: JSON-serialisable provenance written to `sparecycles.json`.
        overwrite: replace a non-empty `out_dir` that holds an earlier export (`out_dir_refusal`).

    Raises:
        TypeError: `model` is neither a PreTrainedModel nor a PromptClassifier.
        FileExistsError: `out_dir` may not be written (`out_dir_refusal`); nothing is deleted.
    """
    from transformers import GenerationConfig, PreTrainedModel

    from trainer.prompt_classifier import LABEL_WORDS, PROMPT_TEMPLATE, PromptClassifier

    info = dict(info or {})
    if isinstance(model, PromptClassifier):
        info["prompt_classifier"] = {"template": PROMPT_TEMPLATE, "label_words": list(LABEL_WORDS),
                                     "label_token_ids": model.label_ids.tolist()}
        model = model.lm
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"cannot export a {type(model).__name__}: need a transformers PreTrainedModel")
    if model.can_generate():  # generation_config.json: BOS/EOS from the tokenizer where the config lacks them
        gen = model.generation_config
        gen = GenerationConfig() if gen is None else copy.deepcopy(gen)
        for key in ("bos_token_id", "eos_token_id"):
            if getattr(gen, key) is None:
                setattr(gen, key, getattr(tokenizer, key))
        model.generation_config = gen

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))

    return _write_folder(out_dir, write, overwrite)


def export_trained(model: torch.nn.Module, cfg_json: dict[str, Any], out_dir: Path, *, step: int,
                   run_dir: Path | None = None, overwrite: bool = True) -> Path:
    """Export a model `trainer.train.train` trained: the task's model class, tokenizer and labels.

    Args:
        model: the trained model (GPT2LMHeadModel for task "lm", BertForSequenceClassification for
            "sentiment").
        cfg_json: the run's config.json (TrainConfig.run_json with the probes' source and `steps`), or
            TrainConfig.run_json alone (the end of `trainer.train.train`).
        out_dir: destination folder; `step`: optimizer steps the weights have taken.
        run_dir: the run folder, for provenance (its summary.json's final metrics are copied when present).

    Raises:
        ExportError: unknown task. FileExistsError: see `export_model`.
    """
    task = cfg_json.get("task", "lm")
    if task == "lm":
        tokenizer = run_tokenizer(cfg_json, model)
    elif task == "sentiment":
        from transformers import AutoTokenizer

        from trainer.models.pretrained import minilm_dir

        tokenizer = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True,
                                                  model_max_length=cfg_json["seq_len"])
        model.config.id2label = dict(SENTIMENT_LABELS)
        model.config.label2id = {v: k for k, v in SENTIMENT_LABELS.items()}
    else:
        raise ExportError(f"cannot export task {task!r}: known tasks are lm and sentiment")
    info: dict[str, Any] = {"source": "sparecycles", "step": step, "config": cfg_json}
    if run_dir is not None:
        info["run_dir"] = str(run_dir)
        summary = Path(run_dir) / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            if s.get("steps") == step:
                info["final"] = {k: v for k, v in s.items() if k.startswith(("final_", "test_"))}
    return export_model(model, out_dir, tokenizer=tokenizer, info=info, overwrite=overwrite)


def run_status(run_dir: Path) -> tuple[dict[str, Any], int, int | None]:
    """(config.json, checkpoint step, steps of the finished run or None) of a run folder.

    A run is finished when summary.json exists and names the checkpoint's step (train() writes it after the
    final checkpoint; a resumed run with more steps is unfinished again until it ends).

    Raises:
        ExportError: the folder is missing, holds no config.json, no checkpoint, or an unreadable one.
    """
    run_dir = Path(run_dir)
    why = not_a_run_folder(run_dir)
    if why is not None:
        raise ExportError(why)
    cfg_path, ckpt = run_dir / "config.json", run_dir / CHECKPOINT_NAME
    if not ckpt.is_file():
        raise ExportError(f"{run_dir} has no {CHECKPOINT_NAME}: the run stopped before its first checkpoint; "
                          "train it (or --resume it) to the end first")
    try:
        with safe_open(str(ckpt), framework="pt") as f:
            step = int(json.loads(f.metadata()["sparecycles"])["step"])
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"checkpoint {ckpt} is unreadable ({exc})") from exc
    summary = run_dir / "summary.json"
    steps = json.loads(summary.read_text()).get("steps") if summary.is_file() else None
    return json.loads(cfg_path.read_text()), step, (steps if steps == step else None)


def _load_model_tensors(ckpt: Path, model: torch.nn.Module) -> None:
    """Copy the checkpoint's `model/*` tensors into `model` (optimizer state is not read).

    Raises ExportError if names or shapes differ.
    """
    params = dict(model.named_parameters())
    with safe_open(str(ckpt), framework="pt") as f:
        saved = {k[len("model/"):] for k in f.keys() if k.startswith("model/")}
        if saved != set(params):
            raise ExportError(f"checkpoint {ckpt} holds parameters {sorted(saved ^ set(params))[:5]} that do "
                              "not match the run's model")
        with torch.no_grad():
            for name, p in params.items():
                src = f.get_tensor(f"model/{name}")
                if src.shape != p.shape:
                    raise ExportError(f"parameter {name}: checkpoint shape {tuple(src.shape)} != "
                                      f"{tuple(p.shape)}")
                p.copy_(src)


def build_run_model(cfg_json: dict[str, Any]) -> torch.nn.Module:
    """An fp32 CPU model of the run's architecture (GPT-2 preset or MiniLM classifier), weights to be
    overwritten.

    Raises ExportError for an unknown task or model preset.
    """
    task = cfg_json.get("task", "lm")
    if task == "sentiment":
        return load_minilm_classifier(seed=int(cfg_json.get("seed", 0)))[0]
    if task != "lm":
        raise ExportError(f"cannot export task {task!r}: known tasks are lm and sentiment")
    try:
        if not is_preset(cfg_json["model"]):  # a transformers folder: its class and config (tiny next to a run)
            return build_causal_lm(cfg_json["model"], seed=int(cfg_json.get("seed", 0)))[0]
        model = build_model(cfg_json["model"], device="meta")  # shapes only: the checkpoint fills the values
    except (KeyError, ValueError) as exc:
        raise ExportError(f"cannot rebuild the run's model: {exc}") from exc
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty allocates wte and lm_head separately; re-share them
    return model


def run_tokenizer(cfg_json: dict[str, Any], model: torch.nn.Module):
    """The transformers tokenizer an LM run's export carries: the project's GPT-2 BPE for a preset, the `--model`
    folder's own tokenizer (AutoTokenizer, local files only) for a folder.

    Raises ExportError when the folder or its tokenizer is gone."""
    spec = cfg_json.get("model", "gpt2-tiny")
    if is_preset(spec):
        return gpt2_tokenizer(model.config.n_positions)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=True, model_max_length=context_of(model.config))
    except Exception as exc:  # OSError/ValueError from transformers for a missing or broken folder
        raise ExportError(f"cannot load the tokenizer of --model {spec}: {type(exc).__name__}") from exc


def export_run(run_dir: Path, out_dir: Path, *, partial: bool = False, overwrite: bool = False,
               best: bool = False) -> Path:
    """Export a run folder's checkpointed model as a transformers folder at `out_dir`; return `out_dir`.

    Args:
        run_dir: a folder `sparecycles train` (or `sparecycles up`) wrote.
        out_dir: destination (created; must be empty, or with `overwrite` an earlier export: `out_dir_refusal`).
        partial: export the checkpoint of an unfinished (interrupted) run instead of refusing.
        best: export the served anytime model (`served.safetensors`, trainer.anytime.serve: the candidate
            chosen at the last evaluation) instead of the trained weights; `sparecycles.json` gets "served"
            (step, candidate, versions, coefficients, its validation loss).

    Raises:
        ExportError: no run folder, no config.json, no or unreadable checkpoint, an unfinished run without
            `partial`, an unknown task/model, or a checkpoint that does not fit the model.
        FileExistsError: `out_dir` may not be written (`out_dir_refusal`: not empty without `overwrite`, or
            `overwrite` on a folder that is not an earlier export, the run folder, ...); nothing is deleted.
    """
    cfg_json, step, finished = run_status(run_dir)
    why = out_dir_refusal(out_dir, overwrite=overwrite, run_dir=run_dir)  # before the model is built
    if why is not None:
        raise FileExistsError(why)
    if finished is None and not partial:
        raise ExportError(f"{run_dir} has not finished: its checkpoint is at step {step} and summary.json "
                          "names no finished run at that step; finish it with "
                          f"`sparecycles train ... --resume`, or pass --partial to export the step-{step} "
                          "weights")
    model = build_run_model(cfg_json)
    if best:
        served = Path(run_dir) / "served.safetensors"
        if not served.is_file():
            raise ExportError(f"{run_dir} has no served.safetensors: train it with --anytime to serve a model")
        _load_model_tensors(served, model)
        with safe_open(str(served), framework="pt") as f:
            meta = json.loads(f.metadata()["sparecycles"])
        model.eval()
        out = export_trained(model, cfg_json, out_dir, step=int(meta["step"]), run_dir=None, overwrite=overwrite)
        info = json.loads((out / EXPORT_INFO).read_text())
        (out / EXPORT_INFO).write_text(json.dumps({**info, "run_dir": str(run_dir), "served": meta}, indent=2))
        return out
    _load_model_tensors(Path(run_dir) / CHECKPOINT_NAME, model)
    model.eval()
    return export_trained(model, cfg_json, out_dir, step=step, run_dir=Path(run_dir), overwrite=overwrite)
