"""The AdamW baseline: schedule closed forms, config validation, real-corpus training, bit-exact resume."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from support.resume import assert_same_checkpoints
from trainer.config import TrainConfig, lr_at, resolve_preset
from trainer.train import train


def test_lr_schedule_closed_form():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    # halfway through the cosine: min + (max-min)/2
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))


def test_config_rejects_bad_values():
    with pytest.raises(ValidationError):
        TrainConfig(lr=float("nan"))
    with pytest.raises(ValidationError):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValidationError):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValidationError):
        TrainConfig(bogus=1)
    with pytest.raises(ValidationError):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    cfg = resolve_preset("demo", {"steps": 7, "lr": None})
    assert (cfg.model, cfg.corpus, cfg.steps) == ("gpt2-tiny", "classics-small", 7)
    assert resolve_preset("gpt2-small", {}).model == "gpt2-small"


def test_unknown_preset_and_corpus_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="gpt2-tiny"):
        train(TrainConfig(model="gpt2-nope", steps=2, warmup_steps=0, run_dir=tmp_path / "a"), progress=False)
    with pytest.raises(ValueError, match="classics-small"):
        train(TrainConfig(corpus="nope", steps=2, warmup_steps=0, run_dir=tmp_path / "b"), progress=False)


def test_resolve_preset_rejects_unknown_names_and_scales_the_default_warmup():
    # --task sentiment ignores the model, so an unknown preset must fail here, not run with LM defaults.
    with pytest.raises(ValueError, match="unknown preset 'nope'.*sentiment-demo.*gpt2-tiny"):
        resolve_preset("nope", {"task": "sentiment"})
    # A model preset sets no warmup: TrainConfig's 30 scales to steps // 10 for a shorter run.
    assert resolve_preset("gpt2-tiny", {"steps": 2}).warmup_steps == 0
    assert resolve_preset("gpt2-tiny", {"steps": 20}).warmup_steps == 2
    assert resolve_preset("gpt2-tiny", {}).warmup_steps == 30
    assert resolve_preset("gpt2-tiny", {"steps": 20, "warmup_steps": 5}).warmup_steps == 5


def _cfg(tmp_path, name, **kw):
    base = dict(model="gpt2-tiny", corpus="classics-small", steps=120, batch_size=8, seq_len=64, lr=3e-3,
                warmup_steps=10, eval_every=40, eval_batches=4, checkpoint_every=40, run_dir=tmp_path / name)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow  # 120 steps of real training
def test_adamw_tiny_learns_real_text(tmp_path):
    res = train(_cfg(tmp_path, "learn"), progress=False)
    # Random init sits at ~ln(50257) = 10.8 nats; 120 steps of 512 tokens reach ~6.5 (measured 6.3-6.6).
    assert res.initial_val_loss > 10.0
    assert res.final_val_loss < res.initial_val_loss - 3.0
    run = res.run_dir
    assert (run / "loss.png").stat().st_size > 10_000
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] == pytest.approx(res.final_val_loss)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 121))
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 40, 80, 120]


@pytest.mark.slow  # two 30-step runs and a resume
def test_interrupt_then_resume_is_bit_identical(tmp_path, fail_at_step):
    from trainer import train as train_mod

    straight = train(_cfg(tmp_path, "straight", steps=30, checkpoint_every=10, eval_every=10), progress=False)
    cfg = _cfg(tmp_path, "resumed", steps=30, checkpoint_every=10, eval_every=10)
    undo = fail_at_step(train_mod.AdamWMode, 17)  # Ctrl-C between checkpoints: the loop saves the position reached
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    undo()
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.summary["resumed_from_step"] == 17
    keys = assert_same_checkpoints(straight.run_dir, resumed.run_dir)
    assert any(k.startswith("optim/") for k in keys)
    assert resumed.final_val_loss == straight.final_val_loss
    recs = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 31))


def test_resume_refuses_a_different_config(tmp_path):
    train(_cfg(tmp_path, "r", steps=4, warmup_steps=1, eval_every=2, checkpoint_every=2), progress=False)
    with pytest.raises(ValueError, match="lr"):
        train(_cfg(tmp_path, "r", steps=4, warmup_steps=1, eval_every=2, checkpoint_every=2, lr=1e-3),
              resume=True, progress=False)


def test_sigterm_stops_between_steps_with_a_checkpoint(tmp_path, monkeypatch):
    import os
    import signal

    from trainer import train as train_mod

    real_step = train_mod.AdamWMode.step

    def terminated(self, step, batch, lr):
        out = real_step(self, step, batch, lr)
        if step == 4:  # `kill`/`timeout` mid-step: the step finishes, then the run checkpoints and stops
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(train_mod.AdamWMode, "step", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    cfg = _cfg(tmp_path, "term", steps=12, warmup_steps=1, eval_every=6, checkpoint_every=6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is restored
    from safetensors import safe_open

    with safe_open(str(tmp_path / "term" / "checkpoint.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["sparecycles"])["step"] == 5  # steps 0..4 done, none cut in half
