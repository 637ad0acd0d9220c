"""Smaller findings of a newcomer's tryout (issue 48), each as the user met it: the progress line of a resumed run,
option refusals in two formats, `--lr nan`, files of `--data` left out without a word, `--text-field` without
`--data`, `export --help`. Real CLI in a subprocess where the user meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT
from trainer.config import TrainConfig


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_a_resumed_run_shows_its_newest_val_loss_not_step_0s(tmp_path, fail_at_step, capsys):
    """Interrupted after the step-4 evaluation and resumed: the progress lines before the next evaluation show step
    4's val loss (they showed step 0's, ~10.8, as if nothing had been learned)."""
    from trainer import train as train_mod
    from trainer.train import train

    cfg = TrainConfig(model="gpt2-tiny", steps=8, batch_size=2, seq_len=16, eval_every=4, eval_batches=1,
                      checkpoint_every=4, warmup_steps=0, lr=1e-2, run_dir=tmp_path / "r")
    undo = fail_at_step(train_mod.AdamWMode, 5)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, export=False)
    undo()
    capsys.readouterr()
    train(cfg, resume=True, progress=True, export=False)  # not a terminal here: plain lines on stderr
    err = capsys.readouterr().err
    vals = {r["step"]: r["val_loss"] for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text()
                                                  .splitlines()) if "val_loss" in r}
    assert vals[4] < vals[0] - 0.01 and f"{vals[4]:.3f}" != f"{vals[0]:.3f}"
    line = next(x for x in err.splitlines() if "step 6/8" in x)
    assert f"val {vals[4]:.3f}" in line, err


@pytest.mark.parametrize(("args", "message"), [
    (["train", "--lr", "2"], "error: --lr: Input should be less than or equal to 1"),
    (["train", "--lr", "nan"], "error: --lr: Input should be a finite number"),  # not "≤ 1"
    (["train", "--device", "gpu"], "error: --device must be cpu or cuda[:N], got 'gpu'"),
    (["train", "--model", "nonexist"], "error: unknown model preset 'nonexist'"),
    (["train", "--lrr", "3"], "error: No such option: --lrr"),
    (["train", "--data", "EMPTY"], "the folder holds no text files"),
    (["train", "--text-field", "body"], "error: --text-field says how --data is read: it needs --data"),
    (["export"], "error: Missing argument 'RUN_DIR'."),
    # a validator's message without pydantic's "Value error, "; the environment variables named, not a list repr
    (["worker", "--coordinator", "http://127.0.0.1:1", "--device", "gpu"], "error: --device: use cpu or cuda:N"),
    (["worker"], "(env var: SPARECYCLES_COORDINATOR_URL or SPARECYCLES_COORDINATOR)"),
])
def test_every_option_refusal_is_one_line_and_exit_2(args, message, tmp_path):
    """click's refusals (a bound, an unknown option, a missing argument) and the commands' checks alike: one line,
    `error: ...`, exit 2 (click printed a four-line usage block for some of them)."""
    (tmp_path / "EMPTY").mkdir()
    run_dir = ["--run-dir", str(tmp_path / "r")] if args[0] == "train" else []
    res = _cli(*[str(tmp_path / a) if a == "EMPTY" else a for a in args], *run_dir)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r").exists()


def test_files_of_data_left_out_are_named(tmp_path):
    """A --data folder of .txt and .csv files: the .csv is left out, and the run says so (it said nothing)."""
    from sparecycles.up_plan import plan_up
    from support.user_data import real_documents

    folder = tmp_path / "my_texts"
    folder.mkdir()
    (folder / "a.txt").write_text(real_documents()[0])
    (folder / "b.csv").write_text("id,text\n1,hello\n")
    (folder / ".hidden.csv").write_text("x")
    res = _cli("train", "--data", str(folder), "--optimizer", "adamw", "--eval-on", "trainer", "--coordinator",
               "http://127.0.0.1:1", "--run-dir", str(tmp_path / "r"))  # refused after the option checks
    warning = next((x for x in res.stderr.splitlines() if x.startswith("warning: --data")), "")
    assert "1 file(s) of a type it does not read left out (b.csv)" in warning and ".txt" in warning, res.stderr
    assert any("b.csv" in w for w in plan_up(settings={"data": str(folder)}, run_dir=tmp_path / "up").warnings)


def test_export_help_names_model_folders():
    text = " ".join(_cli("export", "--help").stdout.split())
    assert "GPT-2 presets)" not in text and "your --model folder's class" in text


def test_up_commands_differing_in_any_setting_get_their_own_folders():
    """`up --teacher DIR` then `up` (or --lr): each setting no tag names goes into a short digest of the folder
    name, so the second command neither refuses the first's folder nor reuses it; the documented names stay."""
    from sparecycles.up_plan import _other_settings, plan_up

    plain = plan_up()
    assert plain.out.name == "up-demo-zocurv-line"
    assert plan_up(settings={"steps": 300}).out.name == "up-demo-zocurv-line-steps300"
    names = {plain.out.name, plan_up(settings={"lr": 1e-3}).out.name, plan_up(settings={"lr": 2e-3}).out.name}
    assert len(names) == 3
    taught = plain.zo_cfg.model_copy(update={"teacher": "runs/some-teacher"})
    assert _other_settings(taught, "demo") == {"teacher": "runs/some-teacher"}
    assert _other_settings(plain.zo_cfg, "demo") == {}
