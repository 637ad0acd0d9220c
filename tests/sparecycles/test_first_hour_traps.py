"""The first hour's traps (issue 48), each as a new user met it: a run too short for its interval, a data refusal
that left a run folder, "starting at at column", progress invisible in a log file, an unknown host retried for two
minutes, config.json's `corpus` beside the user's `data`. Real CLI in a subprocess where the user meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.paths import ROOT
from trainer.config import TrainConfig, recorded_run, resolve_preset
from trainer.methods import METHODS
from trainer.preflight import (
    TOO_SHORT,
    first_probe_step,
    fold_lag,
    folded_rounds,
    no_probe_round_warning,
    probe_rounds,
)

PROBING = [name for name, m in METHODS.items() if m.kind == "zo-curv" and m.needs_probes]  # every method with an interval


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("name", PROBING)
@pytest.mark.parametrize("fleet_wait", [None, "sync", "interval", "never"])
def test_a_run_too_short_for_its_interval_says_so(name, fleet_wait):
    """For every method with a curvature interval and every fold timing: the last run length whose rounds cannot
    fold gets the warning (naming the step the first round folds at and the --steps that fixes it); one step more
    folds exactly one round and gets none."""
    cfg = TrainConfig(optimizer=name, curvature_interval=15, warmup_steps=20, steps=100)
    first = first_probe_step(cfg)
    lag = fold_lag(fleet_wait)
    fold = first + lag * 15  # the 0-based step of the first refresh that can fold a round
    short, enough = cfg.model_copy(update={"steps": fold}), cfg.model_copy(update={"steps": fold + 1})
    assert folded_rounds(short, fleet_wait) == 0 and folded_rounds(enough, fleet_wait) == 1
    assert folded_rounds(enough, fleet_wait) == probe_rounds(enough) - lag  # the round sent at `fold` folds later
    warning = no_probe_round_warning(short, fleet_wait)
    assert warning.startswith(TOO_SHORT) and f"Use --steps {fold + 1} or more" in warning
    assert f"sent at step {first}" in warning and ("slow" not in warning)
    if lag:
        assert f"folds at the refresh after it, step {fold}" in warning
    assert no_probe_round_warning(enough, fleet_wait) is None


def test_up_with_20_steps_is_told_its_run_is_too_short(tmp_path):
    """`up --steps 20` with the demo's curvature interval 15: the round sent at step 15 folds at step 30 at the
    earliest, so `up` says the run is too short (it said nothing, then blamed a slow fleet)."""
    from sparecycles.up import late_rounds_warning
    from sparecycles.up_plan import plan_up

    plan = plan_up(steps=20, run_dir=tmp_path / "up")
    assert plan.zo_cfg.curvature_interval == 15
    (warning,) = plan.warnings
    assert warning.startswith(TOO_SHORT) and "step 30" in warning and "Use --steps 31 or more" in warning
    # the end of the run blames no fleet for what the run's length did
    records = [{"step": 15, "curv_pending_rounds": 1}]
    assert late_rounds_warning(plan, records) is None
    assert "fleet answered slower" in late_rounds_warning(plan_up(steps=31, run_dir=tmp_path / "up31"), records)
    assert plan_up(steps=31, run_dir=tmp_path / "up31").warnings == ()


def test_a_data_refusal_leaves_no_run_folder(tmp_path):
    """An empty .txt and a bad JSON line are found while reading the data: `train` exits 2 with one line and no run
    folder exists (config.json was written first)."""
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": "unterminated\n')
    for data, message in ((tmp_path / "empty.txt", "empty.txt: empty file"),
                          (tmp_path / "bad.jsonl", "bad.jsonl:2: line 2 is not JSON (Unterminated string at column 10)")):
        run = tmp_path / f"run-{data.stem}"
        res = _cli("train", "--data", str(data), "--steps", "2", "--run-dir", str(run))
        assert res.returncode == 2 and f"error: {data}" in res.stderr and message in res.stderr, res.stderr[-2000:]
        assert "at at" not in res.stderr
        assert not run.exists()


def test_progress_is_plain_lines_without_a_terminal():
    """No terminal: a line at the first step and at each twentieth of the steps as they go, not drawn at the end."""
    from trainer.console import plain_progress

    lines: list[str] = []
    show = plain_progress("zocurv-line gpt2-tiny", 40, status=lambda: "workers 2", write=lines.append)
    for done in range(1, 41):
        show(done, f"loss {10 - done / 10:.3f}")
    assert len(lines) == 21 and lines[0] == "zocurv-line gpt2-tiny step 1/40 (2%) loss 9.900 | workers 2"
    assert [line.split()[3] for line in lines[1:]] == [f"{2 * i}/40" for i in range(1, 21)]
    assert lines[-1].startswith("zocurv-line gpt2-tiny step 40/40 (100%)")


def test_train_to_a_log_file_reports_its_steps_as_they_go(tmp_path):
    """`train` with stdout and stderr to files: each of its 4 steps is a line of stderr."""
    res = _cli("train", "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--no-export",
               "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [line for line in res.stderr.splitlines() if " step " in line and line.startswith("adamw gpt2-tiny")]
    assert [s.split()[3] for s in steps] == ["1/4", "2/4", "3/4", "4/4"], res.stderr[-3000:]


def test_an_unknown_host_fails_at_once():
    """A coordinator host that does not resolve is a permanent error: no retry loop of --attach-wait seconds."""
    from fleet import attach as attach_mod

    settings = attach_mod.FleetSettings(admin_token="x" * 24, redis_url="redis://127.0.0.1:6379/0")
    said: list[str] = []
    with pytest.raises(attach_mod.FleetError, match="no such host"):
        attach_mod.attach("http://no-such-host.invalid:8000", settings=settings, wait_s=60.0, log=said.append)
    # never "retrying for up to 60 s": the retry loop says so at its first failure, before its first wait (no wall
    # time asserted: the name service's own answer may be slow on a loaded machine)
    assert said == []


def test_config_json_names_the_data_not_a_corpus():
    """With --data, config.json has no `corpus` (the run never reads it); an older folder's still matches."""
    cfg = resolve_preset("demo", {"data": "my_texts/"})
    assert "corpus" not in cfg.run_json() and cfg.run_json()["data"] == "my_texts/"
    assert resolve_preset("demo", {}).run_json()["corpus"] == "classics-small"
    older = {**cfg.run_json(), "corpus": "classics-small"}
    assert recorded_run(older) == cfg.run_json()
    assert json.loads(json.dumps(recorded_run({"corpus": "classics"}))) == {"corpus": "classics"}
