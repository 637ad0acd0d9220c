"""Drain state and the GPU-busy yield policy of a probe worker (pure state machines, no I/O)."""

from __future__ import annotations

import pytest

from probe_worker.tasks import BusyPolicy, DrainState, gpu_utilization_reader


def test_busy_policy_hysteresis_and_own_work_ignored():
    p = BusyPolicy(threshold_pct=50, n_on=2, n_off=3)
    # (utilization %, this worker busy) -> expected decision after the reading
    script = [
        (90, False, False),  # one hot idle reading is not enough
        (10, False, False),  # a cold one resets the run
        (90, False, False),
        (95, True, False),   # readings during our own task are ignored
        (90, False, True),   # second consecutive hot idle reading: yield
        (10, False, True),
        (10, False, True),
        (80, False, True),   # serving came back: the cold run restarts
        (10, False, True),
        (10, False, True),
        (10, False, False),  # three consecutive cold readings: resume
        (50, False, False),  # the threshold itself counts as busy
        (50, False, True),
    ]
    for util, busy, want in script:
        assert p.update(util, busy) is want, (util, busy)


def test_drain_state_combines_sources_and_signals_changes():
    d = DrainState()
    assert not d.draining
    d.set_remote(True)
    assert d.draining and d.changed.is_set()
    d.changed.clear()
    d.set_remote(True)  # no transition, no wake-up
    assert not d.changed.is_set()
    d.set_policy(True)
    d.set_remote(False)
    assert d.draining  # the policy still holds it
    d.set_policy(False)
    d.set_local(True)
    assert d.draining
    d.set_local(False)
    assert not d.draining


def test_policy_arguments_are_validated():
    for bad in ({"threshold_pct": 0}, {"threshold_pct": 101}, {"threshold_pct": 50, "n_on": 0}):
        with pytest.raises(ValueError):
            BusyPolicy(**bad)
    with pytest.raises(ValueError):
        gpu_utilization_reader("cpu")
