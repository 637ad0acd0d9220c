"""End to end: `sparecycles up --task sentiment --optimizer 1.5spsa` (embedded Valkey, coordinator, 2 probe-worker
processes evaluating the MiniLM-L6 classifier, trainer): the run folder, the fleet's figures, no process left.

Bit-exactness of fleet steps against in-process ones is tests/fleet/test_fleet_sentiment.py's job (cheaper there)."""

from __future__ import annotations

import json

import pytest

from support.events import expected_scalars, same_scalars, tensorboard_scalars
from support.processes import processes_of, start_up

pytestmark = pytest.mark.slow  # end to end: `sparecycles up` with MiniLM-L6 probe workers


def _jsonl_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_up_sentiment_runs_both_runs_through_the_fleet_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "up-sentiment"
    proc = start_up(run_dir, "--eval-windows", "subset", "--task", "sentiment", "--optimizer", "1.5spsa", "--steps", "2", "--probes", "2",
               "--batch-size", "8", "--seq-len", "16")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert processes_of(run_dir) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["task"], summary["model"], summary["corpus"]) == ("sentiment", "minilm-l6", "sentiment")
    assert (summary["optimizer"], summary["steps"], summary["workers"]) == ("1.5spsa", 2, 2)
    assert summary["redis"].startswith("embedded Valkey") and "coordinator_url" not in summary  # dead after exit
    assert summary["fleet"]["workers"] == 2
    assert summary["fleet"]["tasks_published"] >= 2 * 2  # K=2 probes in tasks of one seed, two steps
    # A spot-checked seed's replicas are counted as "held" at intake, not "accepted" (which seed gets checked
    # is random); every delivered result is one or the other. That the trainer received every probe is
    # asserted exactly below (probe_accepted per step).
    fleet = summary["fleet"]
    assert fleet.get("results_accepted", 0) + fleet.get("results_held", 0) >= 2 * 2
    for name in ("adamw", "1.5spsa"):
        recs = _jsonl_records(run_dir / name / "metrics.jsonl")
        assert [r["step"] for r in recs if "loss" in r] == [1, 2]
        evals = [r for r in recs if "val_loss" in r]
        assert [r["step"] for r in evals] == [0, 2]
        assert summary[name]["final_val_acc"] == evals[-1]["val_acc"]
        assert summary[name]["initial_val_loss"] == evals[0]["val_loss"]
        assert 0.0 <= summary[name]["test_acc"] <= 1.0 and summary[name]["test_sentences"] > 1000
    zo_steps = [r for r in _jsonl_records(run_dir / "1.5spsa" / "metrics.jsonl") if "loss" in r]
    for r in zo_steps:
        assert r["forward_passes"] == r["step"] * (2 * 2 + 1) and r["probe_accepted"] == 2 * r["step"]
        assert r["fleet_workers"] == 2 and r["fleet_probes_per_s"] >= 0.0  # the fleet's figures, per step
    for name in ("adamw", "1.5spsa"):  # TensorBoard shows what metrics.jsonl holds, fleet figures included
        assert same_scalars(tensorboard_scalars(run_dir / name), expected_scalars(run_dir / name))
        assert (run_dir / name / "export" / "model.safetensors").is_file()  # --export is the default
    # Step 1's logged loss is L0, the clean loss a worker process computed on the model it built from the
    # published manifest; AdamW's step 1 logs the trainer's own loss of the same initial model on the same
    # batch: equal bit for bit.
    adamw_steps = [r for r in _jsonl_records(run_dir / "adamw" / "metrics.jsonl") if "loss" in r]
    assert zo_steps[0]["loss"] == adamw_steps[0]["loss"]
    assert summary["adamw"]["final_val_loss"] != summary["adamw"]["initial_val_loss"]  # backprop moved theta
    assert (run_dir / "curves.png").stat().st_size > 20_000
