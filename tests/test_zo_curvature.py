"""CurvatureState: staleness bound on rounds, bias-corrected EMA, checkpoint round trip.

Which single results are stale or duplicate is decided by the backend (tests/test_zo_backend.py,
tests/test_zo_probes.py); the state only accumulates those counts and bounds how long a round may wait.
"""

from __future__ import annotations

import pytest
import torch

from trainer.zo.curvature import CurvatureState


def test_round_staleness_bound():
    st = CurvatureState(3, beta=0.5, staleness=2)
    st.set_version(10)
    assert not st.is_stale(8) and st.is_stale(7)  # 10 - 8 = S; 3 > S
    st.set_version(11)
    assert st.is_stale(8)


def test_backwards_version_and_bad_contributions_rejected():
    st = CurvatureState(1)
    st.set_version(3)
    with pytest.raises(ValueError, match="backwards"):
        st.set_version(2)
    with pytest.raises(ValueError):
        st.fold(torch.zeros(2))
    with pytest.raises(ValueError):
        st.fold(torch.tensor([float("inf")]))


def test_bias_corrected_ema_closed_form():
    beta = 0.8
    st = CurvatureState(2, beta=beta, staleness=0)
    xs = [torch.tensor([1.0, -1.0]), torch.tensor([3.0, 5.0]), torch.tensor([-2.0, 0.5])]
    for x in xs:
        st.fold(x)
    w = torch.tensor([beta**2, beta, 1.0], dtype=torch.float64) * (1 - beta)
    expected = (w[:, None] * torch.stack(xs).double()).sum(0) / (1 - beta**3)
    torch.testing.assert_close(st.estimate, expected)


def test_state_dict_round_trip():
    st = CurvatureState(2, beta=0.7, staleness=1)
    st.set_version(5)
    st.fold(torch.tensor([1.0, 2.0]))
    st.counts["stale"] += 3
    other = CurvatureState(2)
    other.load_state_dict({**st.state_dict(), "seen": [[["a", 1], 5]]})  # an older checkpoint's dedupe keys
    torch.testing.assert_close(other.estimate, st.estimate)
    assert other.counts == st.counts and other.current_version == 5 and other.staleness == 1
    with pytest.raises(ValueError):
        CurvatureState(3).load_state_dict(st.state_dict())
