"""The anytime model's pure math (trainer.anytime): candidate coefficients, the mixture, the quadratic fit."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.anytime.candidates import (
    check_coefs,
    ema_coefs,
    mix_state,
    named_candidates,
    raw_coefs,
    uniform_coefs,
)
from trainer.anytime.quadratic import (
    coefs_at,
    fit_quadratic,
    minimise_on_simplex,
    n_params,
    simplex_lattice,
)


def test_named_coefficients_closed_forms():
    assert raw_coefs(3) == (0.0, 0.0, 1.0)
    assert uniform_coefs(4, 2) == (0.0, 0.0, 0.5, 0.5)
    # half-life 1: weights 1/4, 1/2, 1 over 3 versions, normalised by 7/4
    assert ema_coefs(3, 1.0) == pytest.approx((1 / 7, 2 / 7, 4 / 7), abs=1e-15)
    named = named_candidates(8, (1, 4), (1, 4, 8, 9))
    assert list(named) == ["raw", "ema1", "ema4", "avg4", "avg8"]
    for c in named.values():
        assert math.fsum(c) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError):
        check_coefs((0.5, 0.6))
    with pytest.raises(ValueError):
        check_coefs((float("nan"), 1.0))
    with pytest.raises(ValueError):
        ema_coefs(3, 0.0)


def test_mix_state_closed_form_and_fixed_order():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(5, 3, generator=g), "n": torch.tensor([i])} for i in range(3)]
    c = (0.25, 0.25, 0.5)
    out = mix_state(states, c)
    ref = states[0]["w"] * 0.25
    ref += states[1]["w"] * 0.25
    ref += states[2]["w"] * 0.5
    assert torch.equal(out["w"], ref)  # the documented order, bit for bit
    assert torch.equal(out["n"], torch.tensor([2]))  # integer buffers: the newest
    assert torch.equal(mix_state(states, raw_coefs(3))["w"], states[2]["w"])
    with pytest.raises(ValueError):
        mix_state(states, (0.5, 0.5))


def _quadratic(u: torch.Tensor, center: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    x = u[..., 1:] - center
    return 2.0 + 0.5 * ((x @ h) * x).sum(-1)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_fit_recovers_known_minimiser_inside(d):
    # a positive-definite quadratic with its minimum strictly inside the simplex
    center = torch.full((d,), 1.0 / (d + 2), dtype=torch.float64)
    a = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    h = a @ a.T + d * torch.eye(d, dtype=torch.float64)
    u = simplex_lattice(d, 3)
    assert u.shape[0] > n_params(d)
    fit = fit_quadratic(u, _quadratic(u, center, h))
    assert fit.ok, fit.why
    assert fit.residual_rms < 1e-12
    assert torch.allclose(fit.H, h, atol=1e-9)
    u_star, f_star = minimise_on_simplex(fit)
    assert torch.allclose(u_star[1:], center, atol=1e-10)
    assert f_star == pytest.approx(2.0, abs=1e-12)


def test_minimiser_stays_in_the_region_the_design_covers():
    # the unconstrained minimum lies outside (x = (1.5, -0.5)): the answer is on the boundary, and exact
    d, h = 2, torch.eye(2, dtype=torch.float64)
    center = torch.tensor([1.5, -0.5], dtype=torch.float64)
    u = simplex_lattice(d, 3)
    fit = fit_quadratic(u, _quadratic(u, center, h))
    u_star, _ = minimise_on_simplex(fit)
    assert (u_star >= 0).all() and float(u_star.sum()) == pytest.approx(1.0)
    # closest simplex point to (1.5, -0.5) in x-coordinates under the identity metric: x = (1, 0)
    assert torch.allclose(u_star, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), atol=1e-10)


def test_fit_refuses_non_quadratic_and_underdetermined():
    u = simplex_lattice(2, 4)
    x = u[:, 1:]
    quartic = 1.0 + 40 * (x[:, 0] - 0.3) ** 4 + 40 * (x[:, 1] - 0.3) ** 4 + torch.exp(6 * x[:, 0])
    fit = fit_quadratic(u, quartic)
    assert not fit.ok and "not quadratic" in fit.why
    # the same data pass when the stated measurement noise covers the misfit
    assert fit_quadratic(u, quartic, noise=fit.residual_rms).ok
    few = simplex_lattice(2, 2)  # 6 points for 6 parameters
    assert not fit_quadratic(few, quartic[:6] * 0 + few[:, 1]).ok


def test_coefs_at_maps_simplex_points_to_coefficients():
    anchors = torch.tensor([raw_coefs(4), uniform_coefs(4, 4), ema_coefs(4, 1.0)], dtype=torch.float64)
    c = coefs_at(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), anchors)
    assert torch.allclose(c, torch.tensor([0.125, 0.125, 0.125, 0.625], dtype=torch.float64))
    assert float(c.sum()) == pytest.approx(1.0)


def test_build_mixture_sums_in_version_order_whatever_the_term_order():
    from trainer.anytime.ring import build_mixture

    g = torch.Generator().manual_seed(3)
    states = {v: {"w": torch.randn(64, generator=g)} for v in (3, 7, 9)}
    terms = [(9, 0.7), (3, -0.2), (7, 0.5)]
    a = build_mixture(terms, states.__getitem__)
    b = build_mixture(list(reversed(terms)), states.__getitem__)
    assert torch.equal(a["w"], b["w"])
    assert torch.equal(a["w"], mix_state([states[3], states[7], states[9]], (-0.2, 0.5, 0.7))["w"])
    with pytest.raises(ValueError):
        build_mixture([(3, 0.5), (3, 0.5)], states.__getitem__)


def test_selection_scores_each_distinct_mixture_once_and_finds_the_quadratic_minimum():
    from trainer.anytime.select import select_candidate
    from trainer.anytime.settings import AnytimeSettings

    k = 4
    target = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    calls = []

    def score(cands):  # a loss exactly quadratic in c, minimal at `target` (inside the averages' hull)
        calls.extend(cands)
        return [torch.full((3,), 1.0 + float(((torch.tensor(c, dtype=torch.float64) - target) ** 2).sum()),
                           dtype=torch.float64) for _, c in cands]

    sel = select_candidate(k, AnytimeSettings(k=k, half_lives=(1.0, 2.0), windows=(2, 4)), score)
    coefs = [tuple(round(x, 12) for x in c) for _, c in calls]
    assert len(coefs) == len(set(coefs))  # nothing measured twice
    assert sel.fit is not None and sel.fit.ok and sel.fit.residual_rms < 1e-12
    assert sel.quad_meas == pytest.approx(sel.quad_pred, abs=1e-12)  # predicted = measured on a quadratic
    assert sel.winner.mean <= min(s.mean for s in sel.scored) and sel.winner.mean <= sel.raw.mean
