"""The batch wire format between the trainer and probe workers: versioned safetensors blobs, strict decoding.

A round's batch travels once, as a content-addressed blob (DESIGN.md section 3, "Probe round"). The blob is a
safetensors file whose `__metadata__` is exactly {"sparecycles.batch": "<kind>/<version>"} and whose tensors
are exactly the kind's fields, all int64 on the CPU:

- `lm/1`: x (B, T), y (B, T) token ids, y = x shifted by one; loss trainer.models.losses.lm_loss (nats/token);
- `classifier/1`: input_ids (B, T), attention_mask (B, T) in {0, 1}, labels (B,); loss
  trainer.sentiment.classifier_loss (nats/sentence).

A run's kind follows from its model class (the version manifest's `model_class`): `*ForSequenceClassification`
-> classifier, causal LMs -> lm. The trainer (CoordinatorBackend) and the worker (ProbeRuntime) both derive it
with `batch_kind_for_model`, so neither has to be told. Decoding checks the tag, names, dtypes, ranks, shapes
and value ranges and raises `BatchFormatError` naming the first problem; `check_fits` then checks the values
against the model's config (vocabulary, positions, labels), so that a worker rejects a batch its model would
crash on instead of failing inside the forward pass.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Literal

import torch

BatchKind = Literal["lm", "classifier"]
FORMAT_KEY = "sparecycles.batch"
WIRE_VERSION = 1
FIELDS: dict[str, tuple[str, ...]] = {"lm": ("x", "y"), "classifier": ("input_ids", "attention_mask", "labels")}
MAX_HEADER_BYTES = 1 << 16  # a batch header names at most three tensors; anything larger is not ours
MAX_DIM = 1 << 20  # per axis (rows, tokens): far above any batch, far below what would exhaust memory


class BatchFormatError(ValueError):
    """A batch blob that is not a valid `lm/1` or `classifier/1` batch, or does not fit the model it is for."""


def tag(kind: BatchKind) -> str:
    """The metadata tag of `kind` at the current wire version, e.g. "classifier/1"."""
    return f"{kind}/{WIRE_VERSION}"


def batch_kind_for_model(model_class: str) -> BatchKind:
    """The batch kind (and so the loss) of a `transformers` model class name.

    "...ForSequenceClassification" -> "classifier"; "GPT2LMHeadModel" and "...ForCausalLM" -> "lm".
    Raises ValueError for any other class (no loss is defined for it).
    """
    if model_class.endswith("ForSequenceClassification"):
        return "classifier"
    if model_class.endswith("ForCausalLM") or model_class == "GPT2LMHeadModel":
        return "lm"
    raise ValueError(f"no probe loss is defined for model class {model_class!r}; supported: causal LMs "
                     "(GPT2LMHeadModel, *ForCausalLM) and sequence classifiers (*ForSequenceClassification)")




def _problem(kind: str, ts: Sequence[torch.Tensor]) -> str | None:
    """The first reason `ts` (tensors in FIELDS[kind] order, int64 checked) is not a valid batch, else None."""
    names = FIELDS[kind]
    for name, x in zip(names, ts):
        want = 1 if name == "labels" else 2
        if x.dim() != want:
            return f"{name} must have rank {want}, got shape {tuple(x.shape)}"
    b, t = ts[0].shape
    if not (1 <= b <= MAX_DIM and 1 <= t <= MAX_DIM):
        return f"{names[0]} must be (B, T) with 1 <= B, T <= {MAX_DIM}, got {tuple(ts[0].shape)}"
    if kind == "lm":
        if ts[1].shape != ts[0].shape:
            return f"y {tuple(ts[1].shape)} must have the shape of x {tuple(ts[0].shape)}"
        if int(ts[0].min()) < 0 or int(ts[1].min()) < 0:
            return "token ids must be >= 0"
        return None
    ids, mask, labels = ts
    if mask.shape != ids.shape:
        return f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}"
    if tuple(labels.shape) != (b,):
        return f"labels must be ({b},) (one per row), got {tuple(labels.shape)}"
    if int(ids.min()) < 0 or int(labels.min()) < 0:
        return "input_ids and labels must be >= 0"
    if not bool(((mask == 0) | (mask == 1)).all()):
        return "attention_mask must hold only 0 and 1"
    if not bool(mask.any(dim=1).all()):
        return "every row must attend to at least one token (attention_mask row of zeros)"
    return None


def encode_batch(batch: Sequence[torch.Tensor], kind: BatchKind = "lm") -> bytes:
    """Serialise a batch of `kind` to deterministic safetensors bytes (equal batches give equal sha256).

    `batch` is (x, y) for "lm" and (input_ids, attention_mask, labels) for "classifier", int64 as in the
    module docstring (any device; non-contiguous views are fine). Raises TypeError for a wrong number of
    tensors or a non-int64 tensor, ValueError (BatchFormatError) for shapes or values the decoder would refuse.
    """
    from safetensors.torch import save

    if kind not in FIELDS:
        raise ValueError(f"unknown batch kind {kind!r}; use one of {sorted(FIELDS)}")
    names = FIELDS[kind]
    if not (isinstance(batch, (tuple, list)) and len(batch) == len(names)):
        raise TypeError(f"a {kind} batch is a tuple of {len(names)} int64 tensors {names}")
    if not all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 for x in batch):
        raise TypeError(f"every tensor of a {kind} batch {names} must be an int64 torch.Tensor")
    problem = _problem(kind, batch)
    if problem:
        raise BatchFormatError(f"{kind} batch: {problem}")
    # Own copies: safetensors refuses tensors sharing storage (x and y of one row are views of one window).
    tensors = {n: x.detach().cpu().clone(memory_format=torch.contiguous_format) for n, x in zip(names, batch)}
    # One metadata key: safetensors writes the header from a map, so a single key keeps the bytes stable.
    return save(tensors, metadata={FORMAT_KEY: tag(kind)})


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise BatchFormatError("batch blob is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if not 2 <= n <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise BatchFormatError(f"batch blob header length {n} is out of range; not a safetensors batch")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BatchFormatError(f"batch blob header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BatchFormatError("batch blob header is not a JSON object")
    return header


def decode_batch(data: bytes, kind: BatchKind | None = None) -> tuple[torch.Tensor, ...]:
    """Inverse of `encode_batch`: bytes -> the kind's tensors (CPU, int64) in FIELDS order.

    With `kind`, the blob must carry that kind's tag. Raises BatchFormatError (a ValueError) for anything else:
    not safetensors, a missing/unknown/other tag or version, missing or extra tensors, wrong dtype, rank,
    shapes or values.
    """
    from safetensors.torch import load

    meta = _header(data).get("__metadata__")
    known = {tag(k): k for k in FIELDS}
    got = meta.get(FORMAT_KEY) if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or set(meta) != {FORMAT_KEY} or got not in known:
        raise BatchFormatError(f"batch blob metadata must be exactly {{{FORMAT_KEY!r}: one of {sorted(known)}}}, "
                               f"got {meta!r}")
    found = known[got]
    if kind is not None and found != kind:
        raise BatchFormatError(f"expected a {tag(kind)} batch for this model, got a {got} batch")
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for garbled data
        raise BatchFormatError(f"batch blob is not a valid safetensors file: {exc}") from None
    names = FIELDS[found]
    if set(tensors) != set(names):
        raise BatchFormatError(f"a {got} batch holds exactly the tensors {names}, got {sorted(tensors)}")
    ts = tuple(tensors[n] for n in names)
    bad = [n for n, x in zip(names, ts) if x.dtype != torch.int64]
    if bad:
        raise BatchFormatError(f"{got} batch tensors {bad} must be int64")
    problem = _problem(found, ts)
    if problem:
        raise BatchFormatError(f"{got} batch: {problem}")
    return ts


def check_fits(model: torch.nn.Module, kind: BatchKind, batch: Sequence[torch.Tensor]) -> None:
    """Raise BatchFormatError unless a decoded batch of `kind` fits `model`'s config: token ids below
    `vocab_size`, at most `max_position_embeddings` (GPT-2: `n_positions`) tokens, labels below `num_labels`."""
    cfg = model.config
    ids = batch[0]
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None:
        top = max(int(ids.max()), int(batch[1].max()) if kind == "lm" else 0)
        if top >= vocab:
            raise BatchFormatError(f"token id {top} is outside the model's vocabulary of {vocab}")
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if positions is not None and ids.shape[1] > positions:
        raise BatchFormatError(f"{ids.shape[1]} tokens per row exceed the model's {positions} positions")
    if kind == "classifier" and int(batch[2].max()) >= cfg.num_labels:
        raise BatchFormatError(f"label {int(batch[2].max())} is outside the model's {cfg.num_labels} labels")
