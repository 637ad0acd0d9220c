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


def test_no_note_when_the_next_steps_lr_is_the_same_under_both_plans(tmp_path):
    """Inside warmup the lr does not depend on the total: a resume there says nothing (it printed "lr x -> x")."""
    cfg = _cfg(tmp_path, steps=8, warmup_steps=3)
    assert lr_at(1, lr=LR, min_lr=MIN_LR, warmup_steps=3, total_steps=4) == lr_at(
        1, lr=LR, min_lr=MIN_LR, warmup_steps=3, total_steps=8) == 2 * LR / 3
    assert replan_note(cfg, planned_steps=4, at_step=1) is None
    assert replan_note(cfg, planned_steps=4, at_step=3) is None  # warmup's end: lr under both plans
    assert "lr 1.00e-05 -> 9.05e-04" in replan_note(cfg, planned_steps=4, at_step=4)  # past it the plans part


def test_a_resume_with_no_step_left_ends_on_the_evaluation_an_uninterrupted_run_writes(tmp_path, fail_at_step):
    """Interrupted after 4 steps of 8, resumed with --steps 4 (what the refusal of fewer steps suggests): the loop
    runs nothing, and the run must still end on an evaluation of its weights; it reported step 0's val loss as the
    final one. A constant lr (min_lr = lr, no warmup) makes both plans train the same weights, so the summary is
    compared with an uninterrupted 4-step run's, to the bit."""
    from trainer import train as train_mod

    const = dict(min_lr=LR, warmup_steps=0, eval_every=3, checkpoint_every=8)  # no evaluation at step 4 of 8
    whole = train(_cfg(tmp_path / "whole", steps=4, **const), progress=False, export=False)
    undo = fail_at_step(train_mod.AdamWMode, 4)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path / "cut", steps=8, **const), progress=False, export=False)
    undo()
    vals_at = lambda d: {r["step"]: r["val_loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text()  # noqa: E731
                                                               .splitlines()) if "val_loss" in r}
    assert sorted(vals_at(tmp_path / "cut")) == [0, 3]  # interrupted before any evaluation of step 4
    part = train(_cfg(tmp_path / "cut", steps=4, **const), resume=True, progress=False, export=False)
    assert whole.final_val_loss < whole.initial_val_loss - 0.01  # the weights learned: step 0's loss is not final
    assert (part.initial_val_loss, part.final_val_loss) == (whole.initial_val_loss, whole.final_val_loss)
    keys = ("steps", "initial_val_loss", "final_val_loss", "tokens")
    assert {k: part.summary[k] for k in keys} == {k: whole.summary[k] for k in keys}
    assert part.summary["resumed_from_step"] == 4
    assert vals_at(tmp_path / "cut") == vals_at(tmp_path / "whole")  # step 4's evaluation logged, once
    assert folder_state(tmp_path / "cut", _cfg(tmp_path / "cut", steps=4, **const)).kind == "done"


def test_cli_resume_keeps_a_derived_warmup_and_changes_nothing_on_a_finished_run(tmp_path):
    """--warmup-steps left unset is derived from --steps (a 10-step gpt2-tiny run gets 1, 20 steps get 2): a
    --resume to 20 keeps the run's 1 (it was refused: fields ['warmup_steps']); a --resume of the finished run
    changes nothing; --resume with --overwrite is refused; an explicit other --warmup-steps is refused naming the
    recorded one."""
    run = tmp_path / "cli"

    def cli(steps: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", "--preset", "gpt2-tiny", "--steps",
                               str(steps), "--batch-size", "2", "--seq-len", "16", "--lr", "1e-3", "--eval-every", "5",
                               "--eval-batches", "1", "--no-progress", "--no-export", "--run-dir", str(run), *extra],
                              capture_output=True, text=True, timeout=600)

    first = cli(10)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((run / "config.json").read_text())["warmup_steps"] == 1
    refused = cli(20)
    assert refused.returncode == 2
    assert ("(steps: 10 -> 20; warmup_steps: 1 -> 2); pass --resume to continue it to the new --steps (its lr decay "
            "re-planned, its warmup kept)") in refused.stderr
    both = cli(20, "--resume", "--overwrite")
    assert both.returncode == 2 and both.stderr.strip().splitlines() == [
        "error: --resume continues the run in the folder and --overwrite starts it afresh: give one of them"]
    explicit = cli(20, "--resume", "--warmup-steps", "2")
    assert explicit.returncode == 2 and "(recorded -> given: warmup_steps: 1 -> 2)" in explicit.stderr
    resumed = cli(20, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    recorded = json.loads((run / "config.json").read_text())
    assert (recorded["warmup_steps"], recorded["steps"]) == (1, 20)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    kw = dict(lr=1e-3, min_lr=1e-5, warmup_steps=1)
    assert lrs == {**{s + 1: lr_at(s, total_steps=10, **kw) for s in range(10)},
                   **{s + 1: lr_at(s, total_steps=20, **kw) for s in range(10, 20)}}
    summary = (run / "summary.json").read_bytes()
    assert json.loads(summary)["steps"] == 20
    again = cli(20, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [
        f"{run} already holds this run, finished at --steps 20: nothing to resume, nothing changed (a larger --steps "
        "extends it)"]
    assert (run / "summary.json").read_bytes() == summary
