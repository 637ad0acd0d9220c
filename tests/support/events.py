"""TensorBoard scalars of a run folder against its metrics.jsonl (tests of trainer.events and of `up`)."""

from __future__ import annotations

import json
import math

import numpy as np

from trainer.events import scalars_of


def metrics_records(run_dir) -> list[dict]:
    """The records of a run folder's metrics.jsonl (one JSON object a line), in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run folder's event files as TensorBoard's own EventAccumulator reads it: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as TensorBoard shows it: per key, (step, value rounded to float32) in file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in metrics_records(run_dir):
        for k, v in scalars_of(rec).items():
            out.setdefault(k, []).append((rec["step"], float(np.float32(v))))
    return out


def same_scalars(a, b) -> bool:
    """Same tags, steps and values (NaN equals NaN)."""
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(s == t and (x == y or (math.isnan(x) and math.isnan(y)))
                                       for (s, x), (t, y) in zip(a[k], b[k])) for k in a)
