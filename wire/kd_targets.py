"""The distillation-target wire format: sparse teacher targets per position, versioned, checked at intake.

A teacher round answers one batch (B, T) with K entries per token position. The blob is a safetensors
file whose `__metadata__` holds {"sparecycles.kd": "<kind>/1", "vocab": V, "temperature": T} and whose tensors are
exactly:

- `ids` (B, T, K): uint16 when V <= 65,536, else uint32 (safetensors stores U16/U32); token ids in [0, V);
- `logp` (B, T, K): float16 (or float32), the teacher's log-probabilities at temperature T of those ids, finite
  and <= 0.

`kind` is `sampled` (K = S ids drawn with replacement from softmax(teacher_logits / T), duplicates kept; the
estimator weights each 1/S) or `topk` (the K most probable ids, descending). Bytes per step: B*T*K*(2 + 2) for
V <= 65,536 with fp16 log-probs, i.e. 16 x 512 x 16 x 4 = 512 KiB for S = 16.

`decode` checks the tag, names, dtypes, shapes against the batch, id range and finiteness, and raises
`TargetFormatError` naming the first problem; the caller counts the rejection and trains that step on CE alone.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import load, save

from wire.bounds import MAX_KD_K

TargetKind = Literal["sampled", "topk"]
FORMAT_KEY = "sparecycles.kd"
WIRE_VERSION = 1
MAX_K = MAX_KD_K  # entries per position (wire.bounds)


class TargetFormatError(ValueError):
    """A target blob that is not a valid `sampled/1` or `topk/1` blob, or does not fit its batch or vocabulary."""


@dataclass(frozen=True)
class KDTargets:
    """Sparse teacher targets for one batch.

    ids: (B, T, K) int64 token ids in [0, vocab); logp: (B, T, K) float32 teacher log-probs at `temperature`.
    """

    kind: TargetKind
    ids: torch.Tensor
    logp: torch.Tensor
    vocab: int
    temperature: float


def id_dtype(vocab: int) -> torch.dtype:
    """The narrowest unsigned id dtype for a vocabulary of `vocab` ids (uint16 up to 65,536, else uint32)."""
    return torch.uint16 if vocab <= 1 << 16 else torch.uint32


def encode(targets: KDTargets, *, logp_dtype: torch.dtype = torch.float16) -> bytes:
    """Serialise `targets` to a `<kind>/1` safetensors blob (ids narrowed to `id_dtype`, logp to `logp_dtype`).
    The same targets give the same bytes: the header is rewritten with sorted keys (safetensors writes its
    `__metadata__` map in a random order), so a content-addressed target cache can compare blobs byte for byte."""
    meta = {FORMAT_KEY: f"{targets.kind}/{WIRE_VERSION}", "vocab": str(targets.vocab),
            "temperature": repr(float(targets.temperature))}
    tensors = {"ids": targets.ids.to(torch.int64).to(id_dtype(targets.vocab)).contiguous(),
               "logp": targets.logp.to(logp_dtype).contiguous()}
    blob = save(tensors, metadata=meta)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.dumps(json.loads(blob[8 : 8 + n]), separators=(",", ":"), sort_keys=True).encode()
    if len(header) > n:  # cannot happen for the same content; keep safetensors' own bytes rather than guess
        return blob
    return blob[:8] + header.ljust(n, b" ") + blob[8 + n :]  # safetensors pads its header with spaces


def _meta(blob: bytes) -> dict[str, str]:
    if len(blob) < 8:
        raise TargetFormatError(f"target blob of {len(blob)} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > 1 << 16 or 8 + n > len(blob):
        raise TargetFormatError(f"target blob header length {n} does not fit the blob ({len(blob)} bytes)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError as e:
        raise TargetFormatError(f"target blob header is not JSON: {e}") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise TargetFormatError("target blob has no __metadata__")
    return meta


def decode(blob: bytes, *, batch_shape: tuple[int, int], vocab: int) -> KDTargets:
    """Parse and check a target blob for a batch of shape (B, T) and a student vocabulary of `vocab` ids.

    Returns KDTargets with ids int64 and logp float32. Raises TargetFormatError naming the first problem:
    tag/version, vocabulary mismatch, tensor names, dtypes, shape (B, T, K) with 1 <= K <= MAX_K, ids outside
    [0, vocab), non-finite or positive log-probs.
    """
    meta = _meta(blob)
    tag = meta.get(FORMAT_KEY, "")
    kind, _, version = tag.partition("/")
    if kind not in ("sampled", "topk") or version != str(WIRE_VERSION):
        raise TargetFormatError(f"target blob tag {tag!r}: expected 'sampled/1' or 'topk/1'")
    if meta.get("vocab") != str(vocab):
        raise TargetFormatError(f"target blob vocab {meta.get('vocab')!r} != student vocabulary {vocab}")
    try:
        temperature = float(meta.get("temperature", ""))
    except ValueError as e:
        raise TargetFormatError(f"target blob temperature {meta.get('temperature')!r} is not a number") from e
    if not temperature > 0:
        raise TargetFormatError(f"target blob temperature {temperature} must be > 0")
    try:
        tensors = load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError on malformed bodies
        raise TargetFormatError(f"target blob body: {e}") from e
    if set(tensors) != {"ids", "logp"}:
        raise TargetFormatError(f"target blob tensors {sorted(tensors)}: expected ['ids', 'logp']")
    ids, logp = tensors["ids"], tensors["logp"]
    if ids.dtype not in (torch.uint16, torch.uint32):
        raise TargetFormatError(f"target ids dtype {ids.dtype}: expected uint16 or uint32")
    if logp.dtype not in (torch.float16, torch.float32):
        raise TargetFormatError(f"target logp dtype {logp.dtype}: expected float16 or float32")
    b, t = batch_shape
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (b, t) or not 1 <= ids.shape[2] <= MAX_K:
        raise TargetFormatError(f"target ids shape {tuple(ids.shape)}: expected ({b}, {t}, K), 1 <= K <= {MAX_K}")
    if logp.shape != ids.shape:
        raise TargetFormatError(f"target logp shape {tuple(logp.shape)} != ids shape {tuple(ids.shape)}")
    ids64 = ids.to(torch.int64)
    if ids64.numel() and int(ids64.max()) >= vocab:
        raise TargetFormatError(f"target id {int(ids64.max())} out of range for vocabulary {vocab}")
    logp32 = logp.to(torch.float32)
    if not bool(torch.isfinite(logp32).all()):
        raise TargetFormatError("target logp holds NaN or inf")
    if bool((logp32 > 0).any()):
        raise TargetFormatError(f"target logp {float(logp32.max())} > 0 is not a log-probability")
    return KDTargets(kind=kind, ids=ids64, logp=logp32, vocab=vocab, temperature=temperature)  # type: ignore[arg-type]
