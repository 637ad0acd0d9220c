"""Where a run's probes come from is part of the run (a newcomer's tryout): a run trained on a fleet (`train
--coordinator`, `up`) and the same command without a fleet are other runs, so neither is "reused (same settings)" nor
resumed as the other (their val losses differed, 7.286 vs 6.973 at step 33). config.json records the probes' source,
the fleet wait and the fold lag (trainer.preflight.probe_source)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT
from trainer.config import resolve_preset
from trainer.preflight import folder_state, probe_source, run_settings
from trainer.run_dir import RunDir

TINY = {"model": "gpt2-tiny", "batch_size": 2, "seq_len": 16, "steps": 4, "curvature_interval": 2}


def _finished(folder: Path, cfg, fleet_wait: str | None) -> None:
    """What trainer.train leaves of a finished run whose probes came from `fleet_wait`'s fleet (None: in process)."""
    RunDir.open(cfg.model_copy(update={"run_dir": folder}), resume=False, overwrite=False, fleet_wait=fleet_wait)
    (folder / "metrics.jsonl").write_text('{"step": 0, "val_loss": 10.8}\n')
    (folder / "checkpoint.safetensors").write_bytes(b"x")
    (folder / "summary.json").write_text(json.dumps({"steps": cfg.steps}))


def test_probe_source_by_kind_of_method():
    zo, pure, adamw = (resolve_preset("demo", {**TINY, "optimizer": o}) for o in ("zocurv-line", "1.5spsa", "adamw"))
    assert probe_source(zo, "never") == {"probe_source": "fleet", "fleet_wait": "never", "fold_lag": 1}
    assert probe_source(zo, "sync") == {"probe_source": "fleet", "fleet_wait": "sync", "fold_lag": 0}
    assert probe_source(pure, "interval") == {"probe_source": "fleet"}  # each step waits for its round
    assert probe_source(adamw, "never") == {} and probe_source(zo, None) == {}  # no probes / in process: as before
    assert run_settings(zo, "interval")["fold_lag"] == 1 and "probe_source" not in run_settings(zo)


def test_a_fleet_run_is_not_reused_or_resumed_in_process(tmp_path):
    cfg = resolve_preset("demo", {**TINY, "optimizer": "zocurv-line"})
    _finished(tmp_path / "fleet", cfg, "never")
    assert json.loads((tmp_path / "fleet" / "config.json").read_text())["probe_source"] == "fleet"
    assert folder_state(tmp_path / "fleet", cfg, "never").kind == "done"  # the same fleet command: reused
    state = folder_state(tmp_path / "fleet", cfg)  # the same command without a fleet: another run
    assert state.kind == "other" and state.diffs == ("fleet_wait: 'never' -> None", "fold_lag: 1 -> None",
                                                     "probe_source: 'fleet' -> None")
    assert folder_state(tmp_path / "fleet", cfg, "sync").diffs == ("fleet_wait: 'never' -> 'sync'",
                                                                   "fold_lag: 1 -> 0")
    _finished(tmp_path / "local", cfg, None)
    assert folder_state(tmp_path / "local", cfg, "interval").kind == "other"
    with pytest.raises(ValueError, match=r"--resume with a different config.*fleet_wait.*probe_source"):
        RunDir.open(cfg.model_copy(update={"run_dir": tmp_path / "fleet"}), resume=True, overwrite=False)


def test_train_without_a_fleet_refuses_a_fleet_run_folder(tmp_path):
    """The newcomer's command: `train` (in process) over the folder `train --coordinator` finished: exit 2 naming
    where the probes came from, nothing trained."""
    cfg = resolve_preset("demo", {**TINY, "optimizer": "zocurv-line"})
    _finished(tmp_path / "r", cfg, "never")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    args = ["--preset", "demo", "--model", "gpt2-tiny", "--optimizer", "zocurv-line", "--batch-size", "2",
            "--seq-len", "16", "--steps", "4", "--curvature-interval", "2", "--no-progress", "--run-dir",
            str(tmp_path / "r")]
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", *args], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "probe_source: 'fleet' -> None" in res.stderr, res.stderr
    assert "reused" not in res.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == '{"step": 0, "val_loss": 10.8}\n'


def test_up_refuses_a_folder_whose_run_was_probed_in_process(tmp_path, monkeypatch):
    """`up`'s fleet-probed run is another run than `train --run-dir` of its sub-folder without a fleet."""
    from sparecycles.up_plan import plan_up

    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    plan = plan_up(steps=4, curvature_interval=2)
    _finished(plan.out / "zocurv-line", plan.zo_cfg, None)
    with pytest.raises(ValueError, match=r"fleet_wait: None -> 'interval'.*probe_source: None -> 'fleet'"):
        plan_up(steps=4, curvature_interval=2)
    RunDir.open(plan.zo_cfg, resume=False, overwrite=True, fleet_wait="interval")  # what `up` writes
    assert plan_up(steps=4, curvature_interval=2).states["zocurv-line"].kind == "done"
