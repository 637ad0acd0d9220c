"""Every ZO-Curv variant through a real coordinator and a real worker process equals its in-process run bit for bit.

One module-scoped fleet (support.fleet: a coordinator process on real Redis, its own key prefix, one probe-worker
process); the trainer runs in this process attached as `sparecycles train --coordinator --fleet-sync` attaches it
(fleet.attach.Fleet, rounds "sync": each round folds at its own refresh). Every variant's rounds are ordinary probe
kinds (block_scaled, seeded, along_update, group with column slices, line, group_line: zocurv-trust's held-out
role lines), so the worker evaluates exactly what InProcessBackend does. The zero-probe variants are refused before
anything starts.
"""

from __future__ import annotations

import pytest

from fleet.attach import Fleet, FleetStatus
from support.events import metrics_records
from trainer.config import TrainConfig
from trainer.methods import METHODS, fleet_method_names
from trainer.train import TrainHooks, train

pytestmark = pytest.mark.slow  # a coordinator and a worker process, two short runs per variant

# name -> optimizer_options; every zo-curv method with probes that a fleet takes
VARIANTS = {"zocurv-block": {}, "zocurv-sophia": {"granularity": "coordinate"}, "zocurv-line": {},
            "zocurv-group": {}, "zocurv-global": {}, "zocurv-group-global": {},
            "zocurv-trust": {"batches": 2, "start": "one", "agree": 1, "z_min": 0.1}}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from support.fleet import one_worker as fleet_of_one

    with fleet_of_one(tmp_path_factory.mktemp("fleet_zocurv")) as got:
        yield got


def _cfg(tmp_path, name: str, optimizer: str) -> TrainConfig:
    # refreshes at steps 0 and 2 (zocurv-line, -global, -trust: at 2, along θ_2 − θ_1 / θ_2 − θ_0); probe budget 21
    # gives zocurv-group 2 probes per role
    return TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer=optimizer, steps=4, batch_size=2,
                       seq_len=16, lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=100,
                       probes=2, probe_batch_size=1, curvature_interval=2, probe_budget=21, eps=1e-2,
                       optimizer_options=VARIANTS.get(optimizer, {}), run_dir=tmp_path / name)


def _values(run_dir) -> list[tuple[int, str, float]]:
    """Every logged value that does not measure time or the fleet: losses, curvature, multipliers, accepted
    results and rounds (a fleet's redeliveries, counted `duplicate` by the coordinator, and its forward passes
    are its own)."""
    skip = ("elapsed_s", "probe_wall_s", "publish_s", "publish_unix", "forward_passes", "probe_forwards")
    return [(r["step"], k, v) for r in metrics_records(run_dir) for k, v in sorted(r.items())
            if k != "step" and k not in skip and not k.startswith("fleet_") and not k.endswith("_duplicate")]


def test_every_probing_zocurv_variant_runs_on_a_fleet():
    zocurv = [m.name for m in METHODS.values() if m.kind == "zo-curv"]
    assert set(VARIANTS) <= set(fleet_method_names("lm"))
    for name in zocurv:  # the others say why (trainer.methods: no probes, or no_fleet_why)
        m = METHODS[name]
        assert name in VARIANTS or not m.needs_probes or m.no_fleet_why


@pytest.mark.parametrize("optimizer", list(VARIANTS))
def test_fleet_sync_equals_in_process(one_worker, tmp_path, optimizer):
    procs, settings = one_worker
    fleet = Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="zc", rounds="sync")
    on_fleet = train(_cfg(tmp_path, "fleet", optimizer), progress=False, export=False,
                     hooks=TrainHooks(mode_factory=fleet.mode_factory))
    local = train(_cfg(tmp_path, "local", optimizer), progress=False, export=False)
    got, want = _values(on_fleet.run_dir), _values(local.run_dir)
    assert got == want  # floats compared exactly: losses, curvature, multipliers, round counters
    accepted = [v for _, k, v in got if k.endswith("_accepted")]
    assert accepted and max(accepted) > 0  # the worker's results were taken
    assert max(r.get("fleet_results_accepted", 0) for r in metrics_records(on_fleet.run_dir)) > 0


@pytest.mark.parametrize("optimizer", ["zocurv-group-fixed", "zocurv-static", "adamw"])
def test_methods_without_fleet_probes_are_refused(one_worker, tmp_path, optimizer):
    procs, settings = one_worker
    fleet = Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="zc", rounds="sync")
    with pytest.raises(ValueError, match="sends no probes to a fleet"):
        fleet.mode_factory(_cfg(tmp_path, "x", optimizer), None)
