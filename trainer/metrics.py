"""Trainer metrics (prometheus-client, default registry): what the Grafana dashboard plots.

`serve(port)` exposes them over HTTP (the compose trainer and `sparecycles up` do); `record` is called by
the training loop after every step and evaluation.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

STEP = Gauge("sparecycles_trainer_step", "Optimizer steps completed.", ["run"])
LOSS = Gauge("sparecycles_trainer_loss", "Training loss of the last step (nats/token).", ["run"])
VAL_LOSS = Gauge("sparecycles_trainer_val_loss", "Last validation loss (nats/token).", ["run"])
TOKENS = Counter("sparecycles_trainer_tokens", "Training tokens consumed.", ["run"])
CLIPPED = Gauge("sparecycles_trainer_clipped_fraction", "ZO-Curv: fraction of blocks whose multiplier was clipped.",
                ["run"])


def record(run: str, rec: dict[str, Any], tokens_per_step: int) -> None:
    """Fold one metrics record (a step or an evaluation) into the gauges."""
    if "val_loss" in rec:
        VAL_LOSS.labels(run).set(rec["val_loss"])
        return
    STEP.labels(run).set(rec["step"])
    LOSS.labels(run).set(rec.get("loss", float("nan")))
    TOKENS.labels(run).inc(tokens_per_step)
    if "clipped_frac" in rec:
        CLIPPED.labels(run).set(rec["clipped_frac"])


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serve /metrics on addr:port in a daemon thread (prometheus-client's own server)."""
    start_http_server(port, addr=addr)
