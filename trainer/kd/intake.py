"""Intake of teacher target blobs: decode and check (wire.kd_targets), count a rejection, fall back to CE."""

from __future__ import annotations

from trainer.metrics import KD_REJECTED
from wire.kd_targets import KDTargets, TargetFormatError, decode


def accept(blob: bytes, *, batch_shape: tuple[int, int], vocab: int, run: str) -> tuple[KDTargets | None, str]:
    """The blob's targets, or (None, the reason) when wire.kd_targets.decode refuses it; a refusal increments
    `sparecycles_trainer_kd_rejected{run}` and the caller trains that step on CE alone (kd_loss(ce, None, a))."""
    try:
        return decode(blob, batch_shape=batch_shape, vocab=vocab), ""
    except TargetFormatError as e:
        KD_REJECTED.labels(run).inc()
        return None, str(e)
