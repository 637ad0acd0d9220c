"""Figures the docs state about defaults are the ones a plain command gets: `train`'s curvature interval and probe
batch (its default preset is the demo's), and the composed CPU trainer's metrics port is not the one `train
--coordinator` takes by default (both on the host's 127.0.0.1)."""

from __future__ import annotations

import yaml

from support.paths import ROOT


def _row(option: str) -> str:
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    (row,) = [line for line in text.splitlines() if line.startswith(f"| `{option}`")]
    return row


def test_training_doc_states_the_curvature_interval_and_probe_batch_a_plain_train_gets():
    from trainer.config import TrainConfig, resolve_preset
    from trainer.train_cli import TrainCommandOptions

    preset = TrainCommandOptions.model_fields["preset"].default
    assert preset == "demo"
    plain, model_preset = resolve_preset(preset, {}), resolve_preset("gpt2-tiny", {})
    assert (plain.curvature_interval, model_preset.curvature_interval) == (15, 10)
    assert model_preset.curvature_interval == TrainConfig.model_fields["curvature_interval"].default
    row = _row("--curvature-interval")
    assert f"| {plain.curvature_interval} steps with the demo preset" in row
    assert f"; {model_preset.curvature_interval} with a model preset" in row
    probes = _row("--probes`, `--eps`, `--probe-batch-size")
    assert f"{model_preset.probe_batch_size} sequences (demo {plain.probe_batch_size})" in probes


def test_the_composed_cpu_trainer_and_train_coordinator_take_different_metrics_ports():
    from trainer.metrics import DEFAULT_PORT

    pairs = (line.split("=", 1) for line in (ROOT / "docker/.env.example").read_text().splitlines()
             if "=" in line and not line.startswith("#"))
    env = dict(pairs)
    assert int(env["TRAINER_METRICS_PORT"]) != DEFAULT_PORT
    trainer = yaml.safe_load((ROOT / "docker/compose.cpu.yml").read_text())["services"]["trainer"]
    assert f"--metrics-port ${{TRAINER_METRICS_PORT:-{env['TRAINER_METRICS_PORT']}}}" in trainer["command"][0]
