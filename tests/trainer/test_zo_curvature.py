"""CurvatureState: bias-corrected EMA, refused contributions, checkpoint round trip.

Which single results are stale or duplicate is decided by the backend (tests/trainer/test_zo_backend.py,
tests/trainer/test_zo_probes.py); which rounds fold, and the staleness bound on rounds, by the round book
(tests/trainer/test_zo_rounds.py).
"""

from __future__ import annotations

import pytest
import torch

from trainer.zo.curvature import CurvatureState


def test_bad_contributions_rejected():
    st = CurvatureState(1)
    with pytest.raises(ValueError):
        st.fold(torch.zeros(2))
    with pytest.raises(ValueError):
        st.fold(torch.tensor([float("inf")]))


def test_bias_corrected_ema_closed_form():
    beta = 0.8
    st = CurvatureState(2, beta=beta)
    xs = [torch.tensor([1.0, -1.0]), torch.tensor([3.0, 5.0]), torch.tensor([-2.0, 0.5])]
    for x in xs:
        st.fold(x)
    w = torch.tensor([beta**2, beta, 1.0], dtype=torch.float64) * (1 - beta)
    expected = (w[:, None] * torch.stack(xs).double()).sum(0) / (1 - beta**3)
    torch.testing.assert_close(st.estimate, expected)


def test_state_dict_round_trip():
    st = CurvatureState(2, beta=0.7)
    st.fold(torch.tensor([1.0, 2.0]))
    other = CurvatureState(2)
    # an older checkpoint's counters and dedupe keys are ignored
    other.load_state_dict({**st.state_dict(), "seen": [[["a", 1], 5]], "counts": {"stale": 3}, "staleness": 1})
    torch.testing.assert_close(other.estimate, st.estimate, rtol=0, atol=0)
    assert other.beta == 0.7 and other.updates == 1
    with pytest.raises(ValueError):
        CurvatureState(3).load_state_dict(st.state_dict())
