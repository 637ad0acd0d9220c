"""experiments.x2.report's pure helpers: evaluation pauses removed from the wall clock, time to a target loss."""

from __future__ import annotations

import pytest

from experiments.x2.report import time_to_reach, train_wall, val_curve


def _x2_records():
    # steps of 1 s; the evaluation after step 2 took 5 s more (it lands in step 3's interval)
    elapsed = {1: 1.0, 2: 2.0, 3: 8.0, 4: 9.0}
    recs = [{"step": 0, "val_loss": 10.0}]
    for s, e in elapsed.items():
        recs.append({"step": s, "elapsed_s": e, "loss": 1.0})
        if s in (2, 4):
            recs.append({"step": s, "val_loss": {2: 8.0, 4: 6.0}[s]})
    return recs


def test_train_wall_removes_the_evaluation_pause():
    assert train_wall(_x2_records()) == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert val_curve(_x2_records()) == [(0, 0.0, 0.0, 10.0), (2, 2.0, 2.0, 8.0), (4, 4.0, 9.0, 6.0)]


def test_time_to_reach_interpolates_linearly_between_evaluations():
    curve = val_curve(_x2_records())
    assert time_to_reach(curve, 7.0) == (pytest.approx(3.0), pytest.approx(3.0))  # halfway between steps 2 and 4
    assert time_to_reach(curve, 7.0, col=2) == (pytest.approx(5.5), pytest.approx(3.0))
    assert time_to_reach(curve, 6.0) == (pytest.approx(4.0), pytest.approx(4.0))
    assert time_to_reach(curve, 5.9) == (None, None)
