"""`train --resume` with another --steps: the run folder records the steps its lr schedule is built for, and the
resume says in one console line how the lr of its next step changes (it used to re-stretch the decay silently)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from trainer.config import TrainConfig, lr_at, replan_note
from trainer.preflight import folder_state
from trainer.train import train

# lr 1e-3 to min_lr 1e-5 after one warmup step. Planned for 2 steps, the decay is over at step 2: lr_at(2) = min_lr.
# Re-planned over 4, step 2 is a third into the cosine: 1e-5 + 0.5 (1e-3 - 1e-5)(1 + cos(pi/3)) = 7.525e-4; the
# linear decay (to 0) is at 1e-3 (1 - 1/3).
LR, MIN_LR = 1e-3, 1e-5
AT_2_OF_4 = MIN_LR + 0.5 * (LR - MIN_LR) * 1.5


def _cfg(run_dir, **kw) -> TrainConfig:
    base = dict(model="gpt2-tiny", corpus="classics-small", optimizer="adamw", steps=2, batch_size=2, seq_len=16,
                lr=LR, min_lr=MIN_LR, warmup_steps=1, eval_every=2, eval_batches=1, checkpoint_every=2,
                run_dir=run_dir)
    return TrainConfig(**{**base, **kw})


def test_the_note_gives_the_next_steps_lr_under_both_plans(tmp_path):
    cfg = _cfg(tmp_path, steps=4)
    assert lr_at(2, lr=LR, min_lr=MIN_LR, warmup_steps=1, total_steps=2) == MIN_LR
    assert lr_at(2, lr=LR, min_lr=MIN_LR, warmup_steps=1, total_steps=4) == pytest.approx(AT_2_OF_4, rel=1e-12)
    assert replan_note(cfg, planned_steps=2, at_step=2) == (
        "resuming after step 2 with --steps 4: lr 1.00e-05 -> 7.53e-04, the cosine decay built for 2 steps is "
        "re-planned over 4 (--steps 2 keeps the old schedule)")
    linear = _cfg(tmp_path, steps=4, schedule="linear")
    assert replan_note(linear, planned_steps=2, at_step=2) == (
        "resuming after step 2 with --steps 4: lr 0.00e+00 -> 6.67e-04, the linear decay built for 2 steps is "
        "re-planned over 4 (--steps 2 keeps the old schedule)")
    # Shortened midway (planned 6, stopped after 3, now 4): step 3's lr drops from 6.58e-04 to 2.58e-04.
    assert lr_at(3, lr=LR, min_lr=MIN_LR, warmup_steps=1, total_steps=6) == pytest.approx(
        MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * 2 / 5)))
    assert "lr 6.58e-04 -> 2.58e-04" in replan_note(cfg, planned_steps=6, at_step=3)
    # Nothing to say: the same plan, a folder that recorded none, or no step left to run.
    assert replan_note(cfg, planned_steps=4, at_step=2) is None
    assert replan_note(cfg, planned_steps=None, at_step=2) is None
    assert replan_note(cfg, planned_steps=2, at_step=4) is None


def test_an_extended_resume_records_the_steps_and_says_how_the_lr_changes(tmp_path, caplog):
    run = tmp_path / "r"
    train(_cfg(run), progress=False)
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    # An older folder's config.json (no steps) would resume as before; this one is extended, and says so.
    with caplog.at_level("WARNING", logger="trainer.train"):
        res = train(_cfg(run, steps=4), resume=True, progress=False)
    notes = [r.getMessage() for r in caplog.records if r.name == "trainer.train"]
    assert notes == ["resuming after step 2 with --steps 4: lr 1.00e-05 -> 7.53e-04, the cosine decay built for 2 "
                     "steps is re-planned over 4 (--steps 2 keeps the old schedule)"]
    assert res.summary["resumed_from_step"] == 2 and res.summary["steps"] == 4
    assert json.loads((run / "config.json").read_text())["steps"] == 4
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    # The first part ran the 2-step plan; the resumed steps (logged as 3 and 4) run the 4-step one, as said.
    assert lrs == pytest.approx({1: LR, 2: LR, 3: AT_2_OF_4, 4: MIN_LR + 0.5 * (LR - MIN_LR) * 0.5}, rel=1e-12)
    assert folder_state(run, _cfg(run, steps=4)).kind == "done"
    assert folder_state(run, _cfg(run)).diffs == ("steps: 4 -> 2",)
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer.train"):  # the same --steps again: nothing re-planned
        train(_cfg(run, steps=4), resume=True, progress=False)
    assert [r for r in caplog.records if r.name == "trainer.train"] == []
    # Below the checkpoint's step there is nothing to run: refused, and the folder keeps its plan.
    with pytest.raises(ValueError, match="--steps 3 is below the 4 steps the checkpoint .* has taken; resume with "
                                         "--steps 4 or more"):
        train(_cfg(run, steps=3), resume=True, progress=False)
    assert json.loads((run / "config.json").read_text())["steps"] == 4


def test_a_resume_that_fails_before_its_checkpoint_keeps_the_recorded_steps(tmp_path):
    from trainer.checkpoint import CheckpointError

    run = tmp_path / "r"
    train(_cfg(run), progress=False)
    (run / "checkpoint.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(_cfg(run, steps=4), resume=True, progress=False)
    assert json.loads((run / "config.json").read_text())["steps"] == 2  # still the plan its weights were trained on


def test_cli_names_resume_for_a_steps_change_and_prints_the_line(tmp_path):
    run = tmp_path / "cli"

    def args(steps: int) -> list[str]:
        return [sys.executable, "-m", "sparecycles.cli", "train", "--preset", "gpt2-tiny", "--steps", str(steps),
                "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "1", "--lr", "1e-3", "--min-lr", "1e-5",
                "--eval-every", "2", "--eval-batches", "1", "--no-progress", "--no-export", "--run-dir", str(run)]

    first = subprocess.run(args(2), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    longer = args(4)
    refused = subprocess.run(longer, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2
    assert "(steps: 2 -> 4); pass --resume to continue it to the new --steps" in refused.stderr
    resumed = subprocess.run([*longer, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resuming after step 2 with --steps 4: lr 1.00e-05 -> 7.53e-04, the cosine decay built for 2 steps is "
            "re-planned over 4 (--steps 2 keeps the old schedule)\n") in resumed.stderr
    assert json.loads((run / "config.json").read_text())["steps"] == 4
