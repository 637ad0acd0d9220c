"""Trainer metrics (prometheus-client, default registry): what the Grafana dashboard plots.

`serve(port)` exposes them over HTTP: `sparecycles up` on a free port of 127.0.0.1 (listed in the run folder's
prometheus.yml), `train --coordinator` on 127.0.0.1:9102 unless `--metrics-port` says otherwise, the compose trainer
on 0.0.0.0:9102 (ops/prometheus.yml's target). `record` is called by the training loop after every step and
evaluation.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

STEP = Gauge("sparecycles_trainer_step", "Optimizer steps completed.", ["run"])
LOSS = Gauge("sparecycles_trainer_loss", "Training loss of the last step (nats/token).", ["run"])
VAL_LOSS = Gauge("sparecycles_trainer_val_loss", "Last validation loss (nats/token).", ["run"])
TOKENS = Counter("sparecycles_trainer_tokens", "Training tokens consumed.", ["run"])
RUNS_RECREATED = Counter("sparecycles_trainer_runs_recreated", "Times the coordinator lost a fleet run of the trainer "
                         "(probes, evaluation or anytime scoring; its store came back empty) and the trainer created it "
                         "again (fleet.recovery).", ["run"])
CLIPPED = Gauge("sparecycles_trainer_clipped_fraction", "ZO-Curv: fraction of blocks whose multiplier was clipped.",
                ["run"])

KD_LOSS = Gauge("sparecycles_trainer_kd_loss", "--teacher: the KD term of the last step (nats/token, x tau^2).",
                ["run"])
KD_REJECTED = Counter("sparecycles_trainer_kd_rejected", "--teacher: target blobs rejected at intake "
                      "(wire.kd_targets: shape, id range, non-finite); the step trained on CE alone.", ["run"])
KD_MISSING = Counter("sparecycles_trainer_kd_missing_steps", "--teacher on the fleet: steps trained on CE alone "
                     "because their targets had not arrived (or were rejected).", ["run"])
KD_AHEAD = Gauge("sparecycles_trainer_kd_steps_ahead", "--teacher on the fleet: steps of targets answered ahead of "
                 "the trainer.", ["run"])


def record(run: str, rec: dict[str, Any], tokens_per_step: int) -> None:
    """Fold one metrics record (a step or an evaluation) into the gauges."""
    if "val_loss" in rec:
        VAL_LOSS.labels(run).set(rec["val_loss"])
        return
    STEP.labels(run).set(rec["step"])
    LOSS.labels(run).set(rec.get("loss", float("nan")))
    TOKENS.labels(run).inc(tokens_per_step)
    if "kd_loss" in rec:
        KD_LOSS.labels(run).set(rec["kd_loss"])
    if "clipped_frac" in rec:
        CLIPPED.labels(run).set(rec["clipped_frac"])


DEFAULT_PORT = 9102  # `train --coordinator`'s port, and ops/prometheus.yml's trainer target


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics on addr:port in a daemon thread (prometheus-client's own server); port 0: one the OS picks.

    Returns the bound port. Raises OSError when the port is taken or the address is not this host's.
    """
    server, _ = start_http_server(port, addr=addr)
    return server.server_port
