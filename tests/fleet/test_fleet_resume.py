"""A fleet-probed ZO-Curv run interrupted and resumed is the same run as the uninterrupted one, bit for bit.

Real parts: a coordinator process on real Redis (its own key prefix), a probe-worker process, the trainer in
this process attached as `sparecycles train --coordinator` / `up` attach it (fleet.attach.Fleet). The
resumed part gets a new coordinator run (as after a restart): the checkpoint carries the rounds still in
flight and the weight versions they probe, and the resumed trainer publishes and re-issues them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from fleet.attach import Fleet, FleetStatus
from sparecycles.up import FLEET_PARTS, plan_up, run_up, sum_fleet
from support.events import metrics_records
from support.resume import assert_same_checkpoints
from trainer.config import TrainConfig
from trainer.train import TrainHooks, train
from trainer.zo.modes import ZOCurvMode

pytestmark = pytest.mark.slow  # coordinators and worker processes, short fleet-probed runs


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from support.fleet import one_worker as fleet_of_one

    with fleet_of_one(tmp_path_factory.mktemp("fleet_resume")) as got:
        yield got


def _cfg(tmp_path, name: str) -> TrainConfig:
    # zocurv-line, curvature every 3 steps: versions 0, 2, 3, 5, 6 published, rounds at 3 and 6 (base 2, 5)
    return TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer="zocurv-line", steps=8, batch_size=2,
                       seq_len=16, lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=100,
                       probe_batch_size=1, curvature_interval=3, run_dir=tmp_path / name)


def _losses(run_dir) -> list[tuple[int, str, float]]:
    """(step, "loss" | "val_loss", value) in step order: a fleet evaluation's record lands when its result
    arrives (after later steps' losses, by the fleet's timing), so file order is not compared, the values are."""
    return sorted((r["step"], k, r[k]) for r in metrics_records(run_dir) for k in ("loss", "val_loss") if k in r)


def _inflight(run_dir: Path) -> list[dict]:
    """The rounds in flight recorded in a run folder's checkpoint (trainer.zo.optimizers zo_state)."""
    with safe_open(str(run_dir / "checkpoint.safetensors"), framework="pt") as f:
        return json.loads(f.metadata()["sparecycles"])["meta"]["mode"]["curvature"]["inflight"]


def test_fleet_sync_run_interrupted_and_resumed_is_the_same_run(one_worker, tmp_path, fail_at_step):
    """`train --coordinator --fleet-sync`: no round is in flight at a checkpoint, but the resumed part's new
    coordinator run holds no version: θ_{v−1} of the next zocurv-line round is published again from the checkpoint."""
    procs, settings = one_worker

    def attach() -> Fleet:  # a fresh attach per part: a new coordinator run, as after a restart
        return Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="resume", rounds="sync")

    straight = train(_cfg(tmp_path, "straight"), progress=False, export=False, hooks=TrainHooks(mode_factory=attach().mode_factory))
    local = train(_cfg(tmp_path, "local"), progress=False, export=False)  # probed in process
    assert _losses(straight.run_dir) == _losses(local.run_dir) and len(_losses(local.run_dir)) == 8 + 3
    # Ctrl-C before step 6 (its round probes along θ_6 − θ_5): checkpointed after step 5
    undo = fail_at_step(ZOCurvMode, 6)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path, "resumed"), progress=False, export=False, hooks=TrainHooks(mode_factory=attach().mode_factory))
    undo()
    assert _inflight(tmp_path / "resumed") == []
    resumed = train(_cfg(tmp_path, "resumed"), resume=True, progress=False, export=False,
                    hooks=TrainHooks(mode_factory=attach().mode_factory))
    assert resumed.summary["resumed_from_step"] == 6
    assert _losses(resumed.run_dir) == _losses(straight.run_dir)  # floats compared exactly
    assert_same_checkpoints(straight.run_dir, resumed.run_dir)
    folded = [(r["step"], r["curv_accepted"], r["curv_median"]) for r in metrics_records(straight.run_dir) if "curv_median" in r]
    assert len(folded) == 2  # rounds 3 and 6, each folded at its own step in both runs
    assert folded == [(r["step"], r["curv_accepted"], r["curv_median"]) for r in metrics_records(resumed.run_dir)
                      if "curv_median" in r]


@pytest.mark.timeout(1800)
def test_up_interrupted_and_resumed_equals_the_uninterrupted_run(tmp_path, fail_at_step, monkeypatch):
    """`sparecycles up` (rounds fold at the refresh after them): Ctrl-C while round 6 is in flight, rerun: the
    checkpoint carries that round, the rerun's new services get its versions and the round again, and it folds
    at step 9 as in the uninterrupted run. The fleet figures add up both parts."""
    monkeypatch.delenv("REDIS_URL", raising=False)  # up's own Valkey
    monkeypatch.setenv("SPARECYCLES_UP_RUN", "")  # run_up sets it for its children; restored afterwards
    # evaluation on the fleet over the eval_batches windows (the whole split at 4x32 would be 1,361 batches per evaluation)
    opts = dict(steps=10, curvature_interval=3, batch_size=4, seq_len=32, workers=2, eval_windows="subset")

    def up(name: str) -> dict:
        return run_up(plan_up(run_dir=tmp_path / name, **opts), progress=False, export=False, log=lambda m: None)

    straight = up("straight")
    undo = fail_at_step(ZOCurvMode, 7)
    with pytest.raises(KeyboardInterrupt):
        up("resumed")
    undo()
    zo = tmp_path / "resumed" / "zocurv-line"
    assert [(r["round_id"], r["version"], r["base_version"]) for r in _inflight(zo)] == [("line-6", 6, 5)]
    resumed = up("resumed")
    assert resumed["reused"] == ["adamw"]
    a, b = tmp_path / "straight" / "zocurv-line", zo
    assert _losses(a) == _losses(b) and len(_losses(a)) == 10 + 2
    assert_same_checkpoints(a, b)
    untimed = [{k: v for k, v in r["zocurv-line"].items() if k != "time_ledger"} for r in (resumed, straight)]
    assert untimed[0] == untimed[1]  # the time ledgers differ: wall times
    folded = [(r["step"], r["curv_accepted"], r["curv_median"]) for r in metrics_records(a) if "curv_median" in r]
    assert [s for s, *_ in folded] == [7, 10]  # rounds 3 and 6 fold in steps 6 and 9 (logged as completed steps)
    assert folded == [(r["step"], r["curv_accepted"], r["curv_median"]) for r in metrics_records(b) if "curv_median" in r]
    assert "refresh after it" in resumed["rounds"]
    # fleet figures: both parts' coordinator counters summed (round 6 was evaluated in both parts)
    parts = json.loads((zo / FLEET_PARTS).read_text())
    assert len(parts) == 2 and resumed["fleet"] == sum_fleet(parts) and resumed["fleet"]["parts"] == 2
    assert resumed["fleet"]["results_accepted"] == parts[0]["results_accepted"] + parts[1]["results_accepted"]
    assert min(p["results_accepted"] for p in parts) > 0  # part 1: round 3 (and some of 6); part 2: round 6 again
