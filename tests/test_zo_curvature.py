"""CurvatureState: staleness bound, deduplication, bias-corrected EMA, checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from trainer.zo.curvature import CurvatureState, Outcome


def test_stale_contributions_dropped_and_counted():
    st = CurvatureState(3, beta=0.5, staleness=2)
    st.set_version(10)
    assert st.add(torch.tensor([1.0, 2.0, 3.0]), version=8, key=("r8", 0)) is Outcome.ACCEPTED  # 10 - 8 = S
    assert st.add(torch.tensor([100.0, 100.0, 100.0]), version=7, key=("r7", 0)) is Outcome.STALE  # 3 > S
    assert st.add(torch.tensor([9.0, 9.0, 9.0]), version=8, key=("r8", 0)) is Outcome.DUPLICATE
    assert st.counts == {"accepted": 1, "stale": 1, "duplicate": 0 + 1}
    torch.testing.assert_close(st.estimate, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    st.set_version(11)  # version 8 is now stale as well: late redeliveries of it count as stale
    assert st.add(torch.tensor([9.0, 9.0, 9.0]), version=8, key=("r8", 1)) is Outcome.STALE
    assert st.counts["stale"] == 2 and st.updates == 1


def test_future_version_and_backwards_version_rejected():
    st = CurvatureState(1)
    st.set_version(3)
    with pytest.raises(ValueError, match="newer"):
        st.add(torch.zeros(1), version=4)
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
        st.add(x, version=0)
    w = torch.tensor([beta**2, beta, 1.0], dtype=torch.float64) * (1 - beta)
    expected = (w[:, None] * torch.stack(xs).double()).sum(0) / (1 - beta**3)
    torch.testing.assert_close(st.estimate, expected)


def test_state_dict_round_trip():
    st = CurvatureState(2, beta=0.7, staleness=1)
    st.set_version(5)
    st.add(torch.tensor([1.0, 2.0]), 5, key=("a", 1))
    st.add(torch.tensor([1.0, 2.0]), 3, key=("a", 2))
    other = CurvatureState(2)
    other.load_state_dict(st.state_dict())
    torch.testing.assert_close(other.estimate, st.estimate)
    assert other.counts == st.counts and other.current_version == 5 and other.staleness == 1
    assert other.add(torch.tensor([0.0, 0.0]), 5, key=("a", 1)) is Outcome.DUPLICATE
    with pytest.raises(ValueError):
        CurvatureState(3).load_state_dict(st.state_dict())
