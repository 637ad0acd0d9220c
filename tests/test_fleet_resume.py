"""A fleet-probed ZO-Curv run interrupted and resumed is the same run as the uninterrupted one, bit for bit.

Real parts: a coordinator process on real Redis (its own key prefix), a probe-worker process, the trainer in
this process attached as `sparecycles train --coordinator` / `up` attach it (fleet.attach.Fleet). The
resumed part gets a new coordinator run (as after a restart): the checkpoint carries the rounds still in
flight and the weight versions they probe, and the resumed trainer publishes and re-issues them.
"""

from __future__ import annotations

import json

import pytest
import torch

from fleet.attach import Fleet, FleetSettings, FleetStatus
from sparecycles.up import sum_fleet
from support.resume import assert_same_checkpoints
from trainer.config import TrainConfig
from trainer.train import train
from trainer.zo.modes import ZOCurvMode

pytestmark = pytest.mark.slow  # a coordinator and a worker process, four short fleet-probed runs


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from support.fleet import REDIS_URL
    from support.fleet import Fleet as Processes

    procs = Processes(tmp_path_factory.mktemp("fleet_resume"))
    procs.start_worker("a")
    procs.wait_consuming("a")
    try:
        yield procs, FleetSettings(admin_token=procs.admin_token, redis_url=REDIS_URL, key_prefix=procs.prefix)
    finally:
        procs.close()


def _cfg(tmp_path, name: str) -> TrainConfig:
    # zocurv-line, curvature every 3 steps: versions 0, 2, 3, 5, 6 published, rounds at 3 and 6 (base 2, 5)
    return TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer="zocurv-line", steps=8, batch_size=2,
                       seq_len=16, lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=100,
                       probe_batch_size=1, curvature_interval=3, run_dir=tmp_path / name)


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir) -> list[tuple[int, str, float]]:
    return [(r["step"], k, r[k]) for r in _records(run_dir) for k in ("loss", "val_loss") if k in r]


@pytest.mark.parametrize("rounds", ["sync", "next"])
def test_interrupted_fleet_run_resumes_bit_identically(one_worker, tmp_path, fail_at_step, rounds):
    procs, settings = one_worker

    def attach() -> Fleet:  # a fresh attach per part: a new coordinator run, as after a restart
        return Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="resume", rounds=rounds)

    straight = train(_cfg(tmp_path, "straight"), progress=False, export=False, mode_factory=attach().mode_factory)
    # Ctrl-C before step 6: checkpointed after step 5 (version 5 published, round 3 in flight with "next")
    undo = fail_at_step(ZOCurvMode, 6)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path, "resumed"), progress=False, export=False, mode_factory=attach().mode_factory)
    undo()
    resumed = train(_cfg(tmp_path, "resumed"), resume=True, progress=False, export=False,
                    mode_factory=attach().mode_factory)
    assert resumed.summary["resumed_from_step"] == 6
    assert _losses(resumed.run_dir) == _losses(straight.run_dir) and len(_losses(straight.run_dir)) == 8 + 3
    assert_same_checkpoints(straight.run_dir, resumed.run_dir)
    assert resumed.final_val_loss == straight.final_val_loss
    # both rounds were folded, each at the same step in both runs
    folded = [(r["step"], r["curv_accepted"]) for r in _records(straight.run_dir) if "curv_accepted" in r]
    assert folded == [(r["step"], r["curv_accepted"]) for r in _records(resumed.run_dir) if "curv_accepted" in r]
    assert [r["curv_median"] for r in _records(straight.run_dir) if "curv_median" in r]
