"""ZO estimators on quadratics L(θ) = ½θᵀHθ + bᵀθ with known H (float64), directions from the kernels."""

from __future__ import annotations

import math

import pytest
import torch

from probe_kernels import direction, dist_moments
from trainer.zo import estimators as est

N_SAMPLES = 40_000


def _quadratic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    h = a @ a.T / n + torch.diag(torch.rand(n, generator=g, dtype=torch.float64) * 3)
    return h, torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _loss(h: torch.Tensor, b: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """½θᵀHθ + bᵀθ for θ (..., n) -> (...)."""
    return 0.5 * torch.einsum("...i,ij,...j->...", theta, h, theta) + theta @ b


def _probe_losses(h, b, theta, z, eps):
    return _loss(h, b, theta + eps * z), _loss(h, b, theta - eps * z), _loss(h, b, theta)


def _assert_within_se(samples: torch.Tensor, truth: torch.Tensor, k: float = 5.0) -> None:
    """Each column's sample mean is within k standard errors of truth (SE from the samples)."""
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(samples.shape[0])
    z = (mean - truth).abs() / se
    assert bool((z < k).all()), f"max |mean - truth|/SE = {float(z.max()):.2f} (mean {mean}, truth {truth})"


@pytest.mark.parametrize("dist", ["rademacher", "gauss8"])
def test_slope_and_curvature_exact_on_quadratic(dist):
    h, b, theta = _quadratic(12, 1)
    z = direction(7, 0, 5 * 12, dist).double().view(5, 12)
    for eps in (1e-1, 1e-2):
        lp, lm, l0 = _probe_losses(h, b, theta, z, eps)
        grad = h @ theta + b
        torch.testing.assert_close(est.slope(lp, lm, eps), z @ grad, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(est.curvature(lp, lm, l0, eps), torch.einsum("ki,ij,kj->k", z, h, z),
                                   rtol=1e-8, atol=1e-8)


def test_diag_estimator_unbiased_gauss8():
    n = 6
    h, b, theta = _quadratic(n, 2)
    m2, m4 = dist_moments("gauss8")
    z = direction(11, 0, N_SAMPLES * n, "gauss8").double().view(N_SAMPLES, n)
    lp, lm, l0 = _probe_losses(h, b, theta, z, 0.1)
    hk = est.curvature(lp, lm, l0, 0.1)
    c = est.leave_one_out_mean(hk)
    per_probe = (hk - c)[:, None] * (z * z - m2) / (m4 - m2 * m2)
    torch.testing.assert_close(est.diag_estimate(hk, z, c, m2, m4), per_probe.mean(0))
    _assert_within_se(per_probe, torch.diagonal(h))
    # The control variate is a variance reduction, not a bias fix: c = 0 is unbiased too, and noisier.
    raw = hk[:, None] * (z * z - m2) / (m4 - m2 * m2)
    _assert_within_se(raw, torch.diagonal(h))
    assert bool((per_probe.std(0) < raw.std(0)).all())


def test_diag_estimator_rejects_rademacher():
    with pytest.raises(ValueError, match="gauss8"):
        est.diag_estimate(torch.ones(2), torch.ones(2, 3), 0.0, 1.0, 1.0)


def test_block_trace_estimator_unbiased_with_cross_block_coupling():
    sizes = [3, 5, 4]
    n = sum(sizes)
    h, b, theta = _quadratic(n, 3)  # dense H: cross-block terms present and must cancel
    m2, m4 = dist_moments("gauss8")
    a = direction(21, 0, N_SAMPLES * len(sizes), "gauss8").double().view(N_SAMPLES, len(sizes))
    r = direction(22, 0, N_SAMPLES * n, "rademacher").double().view(N_SAMPLES, n)
    z = a.repeat_interleave(torch.tensor(sizes), dim=1) * r
    lp, lm, l0 = _probe_losses(h, b, theta, z, 0.1)
    hk = est.curvature(lp, lm, l0, 0.1)
    c = est.leave_one_out_mean(hk)
    per_probe = (hk - c)[:, None] * (a * a - m2) / (m4 - m2 * m2)
    bounds = [0, 3, 8, 12]
    traces = torch.stack([torch.diagonal(h)[bounds[i]:bounds[i + 1]].sum() for i in range(3)])
    torch.testing.assert_close(est.block_trace_estimate(hk, a, c, m2, m4), per_probe.mean(0))
    _assert_within_se(per_probe, traces)


def test_block_scaled_direction_is_defined_by_seed_and_offsets():
    sizes, offsets = [4, 7, 130], [0, 4, 11]
    z = est.block_scaled_direction(99, offsets, sizes)
    a = est.block_scales(99, 3)
    r = direction(est.block_sign_seed(99), 0, 141, "rademacher")
    torch.testing.assert_close(z, est.block_scaled_probe(a, r, sizes), rtol=0, atol=0)
    # Block 2 alone (a worker holding one shard) reproduces its slice from (seed, offset).
    part = a[2] * direction(est.block_sign_seed(99), 11, 130, "rademacher")
    assert torch.equal(z[11:], part)
    assert est.block_sign_seed(99) != 99 and est.derive_seed(99, est.TAG_BLOCK_SCALE) != est.block_sign_seed(99)


def test_rademacher_mixed_difference_exact_and_diag_unbiased():
    n = 5
    h, b, theta = _quadratic(n, 4)
    u = direction(31, 0, N_SAMPLES * n, "rademacher").double().view(N_SAMPLES, n)
    v = direction(32, 0, N_SAMPLES * n, "rademacher").double().view(N_SAMPLES, n)
    eps = 0.1
    def f(x):
        return _loss(h, b, theta + eps * x)
    uhv = est.mixed_difference(f(u + v), f(u - v), f(-u + v), f(-u - v), eps)
    torch.testing.assert_close(uhv, torch.einsum("ki,ij,kj->k", u, h, v), rtol=1e-8, atol=1e-8)
    per_probe = uhv[:, None] * u * v
    torch.testing.assert_close(est.rademacher_diag_estimate(uhv, u, v), per_probe.mean(0))
    _assert_within_se(per_probe, torch.diagonal(h))


def test_spsa15_alpha1_is_newton_step_along_each_probe():
    h, b, theta = _quadratic(8, 5)
    z = direction(41, 0, 3 * 8, "rademacher").double().view(3, 8)
    lp, lm, l0 = _probe_losses(h, b, theta, z, 1e-2)
    g, hk = est.slope(lp, lm, 1e-2), est.curvature(lp, lm, l0, 1e-2)
    # K = 1, lr = 1: θ − (g/|h|)·z is the exact minimiser of L along z (H is positive definite here).
    c = est.spsa15_coefficients(g[:1], hk[:1], lr=1.0, alpha=1.0, lam=1e-12)
    new = theta + c[0] * z[0]
    torch.testing.assert_close(new, theta - (z[0] @ (h @ theta + b)) / (z[0] @ h @ z[0]) * z[0])
    assert abs(float(z[0] @ (h @ new + b))) < 1e-9  # zero slope along the probe at the new point
    # K = 3: each probe contributes its own 1-D Newton step, averaged.
    c3 = est.spsa15_coefficients(g, hk, lr=0.5, alpha=1.0, lam=1e-12)
    torch.testing.assert_close(c3, -(0.5 / 3) * g / hk.abs())


def test_coefficients_and_weights():
    g, h = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([4.0, 0.01, -16.0])
    torch.testing.assert_close(est.spsa_coefficients(g, 0.3), -0.1 * g.double())
    torch.testing.assert_close(est.spsa15_weights(h, 0.5, 1.0), torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64))
    torch.testing.assert_close(est.mezo_coefficients(torch.tensor([2.0]), 0.1), torch.tensor([-0.2], dtype=torch.float64))
    with pytest.raises(ValueError):
        est.mezo_coefficients(g, 0.1)
    with pytest.raises(ValueError):
        est.spsa15_weights(h, 0.1, 0.0)
    with pytest.raises(ValueError):
        est.slope([1.0], [float("nan")], 1e-3)
    with pytest.raises(ValueError):
        est.curvature([1.0], [1.0], 1.0, 0.0)


def test_leave_one_out_mean():
    h = torch.tensor([1.0, 2.0, 6.0])
    torch.testing.assert_close(est.leave_one_out_mean(h), torch.tensor([4.0, 3.5, 1.5], dtype=torch.float64))
    with pytest.raises(ValueError):
        est.leave_one_out_mean(torch.tensor([1.0]))


def test_seed_derivation_deterministic_and_distinct():
    s = est.step_seeds(123, 7, 16)
    assert s == est.step_seeds(123, 7, 16)
    assert len(set(s) | set(est.step_seeds(123, 8, 16)) | set(est.step_seeds(124, 7, 16))) == 48
    assert all(0 <= x < 2**63 for x in s)
    with pytest.raises(ValueError):
        est.derive_seed(-1)
    with pytest.raises(TypeError):
        est.derive_seed(1.5)
