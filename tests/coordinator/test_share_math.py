"""The pure share rule (coordinator.share_math): targets, the choice of a worker's run, and a closed-form simulation of
a pool under it (discrete time, tasks of fixed length) whose worker-seconds follow the shares."""

from __future__ import annotations

import math

import pytest

from coordinator.share_math import RunLoad, choose_run, share_fractions, start_base, targets


def test_targets_closed_form() -> None:
    assert targets({"a": 3.0, "b": 1.0}, 4) == {"a": 3.0, "b": 1.0}
    assert targets({"a": 3.0, "b": 1.0}, 3) == {"a": 2.25, "b": 0.75}
    assert targets({"a": 1.0, "b": 1.0, "c": 2.0}, 2) == {"a": 0.5, "b": 0.5, "c": 1.0}
    assert targets({}, 5) == {}
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="share of a"):
            targets({"a": bad}, 1)
    with pytest.raises(ValueError, match="n_workers"):
        targets({"a": 1.0}, -1)


def test_vtime_and_start_base() -> None:
    assert RunLoad(share=4.0, worker_s=10.0, base=2.5).vtime == 5.0
    assert start_base({"a": 7.0, "b": 3.5}) == 3.5
    assert start_base({}) == 0.0


def test_whole_workers_follow_the_targets() -> None:
    # 4 workers, shares 3:1: three on a, one on b, whatever the virtual times.
    loads = {"a": RunLoad(3.0, worker_s=900.0, workers=2), "b": RunLoad(1.0, worker_s=0.0, workers=1)}
    assert choose_run(loads, "a", 4, 1.0) == "a"  # a is 1 short of 3: stays although b is far more owed
    loads = {"a": RunLoad(3.0, worker_s=0.0, workers=3), "b": RunLoad(1.0, worker_s=900.0, workers=0)}
    assert choose_run(loads, "a", 4, 1.0) == "b"  # b is 1 short of 1: goes there although a is more owed


def test_fraction_goes_to_the_most_owed_with_hysteresis() -> None:
    # 3 workers, 3:1: targets 2.25 / 0.75; with the two others on a, this worker's run is decided by virtual time.
    def loads(wa: float, wb: float) -> dict[str, RunLoad]:
        return {"a": RunLoad(3.0, worker_s=wa, workers=2), "b": RunLoad(1.0, worker_s=wb, workers=0)}

    assert choose_run(loads(30.0, 9.5), "a", 3, 1.0) == "a"  # v_a = 10, v_b = 9.5: within the hysteresis, stays
    assert choose_run(loads(30.0, 8.5), "a", 3, 1.0) == "b"  # v_b 1.5 below: switches to the most owed
    assert choose_run(loads(30.0, 8.5), None, 3, 1.0) == "b"  # a newcomer takes the most owed
    assert choose_run(loads(30.0, 8.5), "a", 3, 2.0) == "a"  # a wider hysteresis keeps it


def test_work_conserving() -> None:
    idle_b = {"a": RunLoad(1.0, worker_s=50.0, workers=0), "b": RunLoad(1.0, worker_s=0.0, waiting=False)}
    assert choose_run(idle_b, "b", 2, 1.0) == "a"  # b has nothing waiting: the worker goes to a
    nothing = {"a": RunLoad(1.0, waiting=False), "b": RunLoad(2.0, waiting=False)}
    assert choose_run(nothing, "a", 2, 1.0) is None  # no run waiting: every queue
    assert choose_run({}, None, 1, 1.0) is None
    one = {"b": RunLoad(1.0, workers=3)}  # a run alone takes the whole pool (the other one ended)
    assert choose_run(one, "a", 4, 1.0) == "b"
    with pytest.raises(ValueError, match="hysteresis"):
        choose_run(one, None, 1, -1.0)


def _simulate(shares: dict[str, float], n_workers: int, task_s: float, steps: int, hysteresis: float) -> dict:
    """Worker-seconds per run after `steps` task lengths: every worker re-chooses at each task's end (all runs
    always waiting), tasks of `task_s` seconds, W added at the end of each task."""
    runs = sorted(shares)
    worker_s = {r: 0.0 for r in runs}
    on: list[str | None] = [None] * n_workers
    for _ in range(steps):
        for w in range(n_workers):
            counts = {r: sum(1 for i, x in enumerate(on) if x == r and i != w) for r in runs}
            loads = {r: RunLoad(shares[r], worker_s[r], 0.0, True, counts[r]) for r in runs}
            on[w] = choose_run(loads, on[w], n_workers, hysteresis)
        for w in range(n_workers):
            worker_s[on[w]] += task_s
    return worker_s


@pytest.mark.parametrize(("shares", "n"), [({"a": 3.0, "b": 1.0}, 3), ({"a": 3.0, "b": 1.0}, 4),
                                           ({"a": 1.0, "b": 1.0}, 3), ({"a": 2.0, "b": 1.0, "c": 1.0}, 3)])
def test_simulated_pool_follows_the_shares(shares: dict[str, float], n: int) -> None:
    # 600 tasks of 0.5 s per worker: each run's fraction within (hysteresis + one task) / total of its share.
    worker_s = _simulate(shares, n, 0.5, 600, 1.0)
    total = sum(worker_s.values())
    assert total == n * 0.5 * 600
    frac = share_fractions(worker_s)
    for run, s in shares.items():
        want = s / sum(shares.values())
        # v_r differ by at most hysteresis + task_s, so W_r is off by at most s_r * 1.5 worker-seconds per run
        assert abs(frac[run] - want) <= len(shares) * s * 1.5 / total + 1e-12, (run, frac, want)
    assert share_fractions({"a": 0.0, "b": 0.0}) == {"a": 0.0, "b": 0.0}
