"""TensorBoard event files (trainer.events) hold exactly the scalars of metrics.jsonl, read back with
TensorBoard's own EventAccumulator and with the CRC-checking reader trainer.events.read_scalars: a ZO-Curv run
(curvature counters and spread), and a crashed-then-resumed run whose events past the checkpoint (and a torn
last record) are dropped as metrics.jsonl's records are."""

from __future__ import annotations

import math

import pytest

from support.events import expected_scalars, same_scalars, tensorboard_scalars
from trainer.config import TrainConfig
from trainer.events import EVENTS_GLOB, read_events, read_scalars, scalars_of
from trainer.train import train


def test_scalars_of_takes_numbers_but_not_step_bools_or_structures():
    rec = {"step": 3, "loss": 2.5, "n": 4, "flag": True, "name": "x", "xs": [1.0], "nan": float("nan")}
    got = scalars_of(rec)
    assert set(got) == {"loss", "n", "nan"} and got["n"] == 4.0 and math.isnan(got["nan"])


def test_zocurv_run_events_hold_the_metrics_jsonl_scalars(tmp_path):
    cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer="zocurv-block", steps=4,
                      batch_size=4, seq_len=32, warmup_steps=1, eval_every=2, eval_batches=2,
                      checkpoint_every=4, probes=2, probe_batch_size=2, curvature_interval=2, run_dir=tmp_path / "zc")
    res = train(cfg, progress=False, export=False)
    assert not (res.run_dir / "export").exists()
    assert len(list(res.run_dir.glob(EVENTS_GLOB))) == 1
    want, got = expected_scalars(res.run_dir), tensorboard_scalars(res.run_dir)
    # losses, lr, the curvature round's counters (accepted/stale/duplicate) and spread are all there
    assert {"loss", "val_loss", "lr", "grad_norm", "clipped_frac", "curv_accepted", "curv_stale",
            "curv_duplicate"} <= set(want)
    counts = ("curv_accepted", "curv_stale", "curv_duplicate")
    assert any(k.startswith("curv_") and k not in counts for k in want)
    assert same_scalars(got, want), (sorted(got), sorted(want))
    assert same_scalars(read_scalars(res.run_dir), want)
    assert [s for s, _ in got["val_loss"]] == [0, 2, 4]


def test_resume_after_a_crash_purges_the_events_past_the_checkpoint(tmp_path, fail_at_step):
    from trainer import train as train_mod

    cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", steps=4, batch_size=4, seq_len=32,
                      warmup_steps=1, eval_every=2, eval_batches=2, checkpoint_every=2, run_dir=tmp_path / "r")
    # a crash (not Ctrl-C): step 3 was logged, the last checkpoint is step 2
    undo = fail_at_step(train_mod.AdamWMode, 3, RuntimeError("worker node lost"))
    with pytest.raises(RuntimeError, match="node lost"):
        train(cfg, progress=False, export=False)
    assert same_scalars(tensorboard_scalars(cfg.run_dir), expected_scalars(cfg.run_dir))  # steps 1..3 so far
    assert max(s for s, _ in tensorboard_scalars(cfg.run_dir)["loss"]) == 3
    (old,) = cfg.run_dir.glob(EVENTS_GLOB)
    with old.open("ab") as f:  # and the crash tore a record in half
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00\x01\x02")
    assert same_scalars(read_scalars(cfg.run_dir), expected_scalars(cfg.run_dir))  # the reader stops at the torn record
    undo()
    train(cfg, resume=True, progress=False, export=False)
    assert len(list(cfg.run_dir.glob(EVENTS_GLOB))) == 2
    want, got = expected_scalars(cfg.run_dir), tensorboard_scalars(cfg.run_dir)
    assert [s for s, _ in want["loss"]] == [1, 2, 3, 4]  # the crashed step 3 logged once, by the resumed run
    assert same_scalars(got, want) and same_scalars(read_scalars(cfg.run_dir), want)
    # the old file itself lost step 3 and the torn record
    assert max(e.step for e in read_events(old)) == 2 and not old.read_bytes().endswith(b"\x01\x02")
    train(cfg, overwrite=True, progress=False, export=False)  # afresh: the old files go
    assert len(list(cfg.run_dir.glob(EVENTS_GLOB))) == 1 and same_scalars(tensorboard_scalars(cfg.run_dir),
                                                                  expected_scalars(cfg.run_dir))
