"""A corrupt checkpoint is one clear line and exit 2 (not a traceback), for `train --resume` and for `up` on an
interrupted folder; `--overwrite` starts again. Real tiny runs, real safetensors files, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

TINY = ("--steps", "2", "--batch-size", "2", "--seq-len", "16")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def _corrupt(ckpt: Path, how: str) -> None:
    if how == "truncated":  # a copy or save cut short: the header is whole, the tensors are not
        os.truncate(ckpt, ckpt.stat().st_size // 2)
    else:  # not a safetensors file at all (bad header length)
        ckpt.write_bytes(b"not a checkpoint")


def _assert_one_line_error(res: subprocess.CompletedProcess, ckpt: Path) -> None:
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "SafetensorError:" not in res.stderr.replace("(SafetensorError:", "")
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and str(ckpt) in line[0] and "corrupt or truncated" in line[0] and "--overwrite" in line[0]


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_train_resume_of_a_corrupt_checkpoint_is_one_line_exit_2(tmp_path, how):
    run = tmp_path / "r"
    args = (*TINY, "--eval-every", "2", "--checkpoint-every", "1", "--run-dir", str(run), "--no-progress", "--no-export")
    assert _cli("train", *args).returncode == 0
    (run / "summary.json").unlink()  # interrupted after its last checkpoint
    ckpt = run / "checkpoint.safetensors"
    _corrupt(ckpt, how)
    _assert_one_line_error(_cli("train", *args, "--resume"), ckpt)
    if how == "garbage":  # the advice works: --overwrite trains the run again from step 0
        res = _cli("train", *args, "--overwrite")
        assert res.returncode == 0, res.stderr[-3000:]
        assert (run / "summary.json").is_file()


def test_up_on_an_interrupted_folder_with_a_corrupt_checkpoint_is_one_line_exit_2(tmp_path):
    from sparecycles.up_plan import plan_up
    from trainer.checkpoint import checkpoint_problem
    from trainer.train import train

    out = tmp_path / "up"
    plan = plan_up(steps=2, batch_size=2, seq_len=16, run_dir=out)
    train(plan.base_cfg, progress=False, export=False)  # `up`'s AdamW run, then "interrupted"
    (out / "adamw" / "summary.json").unlink()
    ckpt = out / "adamw" / "checkpoint.safetensors"
    assert checkpoint_problem(ckpt) is None
    assert plan_up(steps=2, batch_size=2, seq_len=16, run_dir=out).states["adamw"].kind == "resume"
    _corrupt(ckpt, "truncated")
    # plan_up is the first thing `up` does: the error comes before any coordinator or worker starts
    _assert_one_line_error(_cli("up", *TINY, "--run-dir", str(out), "--no-progress"), ckpt)


@pytest.mark.parametrize("made", [False, True])
def test_train_resume_where_no_run_was_started_writes_nothing(tmp_path, made):
    """`train --resume` on a mistyped folder (absent, or empty) is one line and exit 2, and leaves it as it was: it
    wrote config.json there before finding no checkpoint (a newcomer's tryout)."""
    run = tmp_path / "none"
    if made:
        run.mkdir()
    res = _cli("train", *TINY, "--run-dir", str(run), "--no-progress", "--resume")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and f"nothing to resume in {run}" in line[0] and "without --resume" in line[0]
    assert (sorted(run.iterdir()) == [] if made else not run.exists())
