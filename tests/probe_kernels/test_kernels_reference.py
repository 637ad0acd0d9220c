"""Reference direction: offset invariance, distribution moments, independence of seeds, API checks."""

import itertools
import math

import numpy as np
import pytest
import torch

import probe_kernels
from probe_kernels import GAUSS8_TABLE, KAPPA, ProbeDist, direction, gauss8_moments, perturb, replay_
from probe_kernels.reference import direction_codes

N = 1 << 20


def test_gauss8_table_is_unit_variance_symmetric_quantiles():
    t = GAUSS8_TABLE.astype(np.float64)
    assert GAUSS8_TABLE.dtype == np.float32 and GAUSS8_TABLE.shape == (256,)
    assert np.all(np.diff(t) > 0) and np.array_equal(t, -t[::-1])
    m2, m4 = gauss8_moments()
    assert abs(m2 - 1.0) < 1e-6 and m4 == KAPPA
    assert 2.85 < KAPPA < 3.0  # a discretised Gaussian's kurtosis sits just under 3
    assert abs(t.mean()) == 0.0


@pytest.mark.parametrize("dist", list(ProbeDist))
def test_offset_invariance_chunks_concatenate(dist):
    seed, start, n = (1 << 40) + 17, 999, 5000
    whole = direction(seed, start, n, dist)
    cuts = [0, 1, 15, 16, 17, 127, 128, 129, 1000, 4095, 5000]
    parts = [direction(seed, start + a, b - a, dist) for a, b in itertools.pairwise(cuts)]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("dist", list(ProbeDist))
def test_moments_match_table_within_six_standard_errors(dist):
    z = direction(2024, 12345, N, dist).double()
    t = torch.from_numpy(GAUSS8_TABLE.astype(np.float64)) if dist is ProbeDist.GAUSS8 else torch.tensor([-1.0, 1.0])
    m = [float((t**k).mean()) for k in range(9)]
    for k in (1, 2, 4):
        se = math.sqrt(max(m[2 * k] - m[k] ** 2, 0.0) / N)
        est = float((z**k).mean())
        assert abs(est - m[k]) <= 6 * se + 1e-12, (k, est, m[k], se)


def test_gauss8_codes_are_uniform_bytes():
    counts = torch.bincount(direction_codes(7, 0, N, "gauss8"), minlength=256).double()
    chi2 = float(((counts - N / 256) ** 2 / (N / 256)).sum())
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)


@pytest.mark.parametrize("dist", list(ProbeDist))
@pytest.mark.parametrize("s1,s2", [(1, 2), (5, 5 + (1 << 32)), (0, (1 << 64) - 1)])
def test_different_seeds_are_uncorrelated(dist, s1, s2):
    n = 1 << 18
    a, b = direction(s1, 0, n, dist).double(), direction(s2, 0, n, dist).double()
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(r) < 5 / math.sqrt(n)


def test_neighbouring_elements_uncorrelated():
    n = 1 << 18
    z = direction(3, 0, n + 1, "gauss8").double()
    r = float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])
    assert abs(r) < 5 / math.sqrt(n)


def test_perturb_dtypes_round_once_from_fp32():
    w = torch.linspace(-1, 1, 1001).to(torch.bfloat16)
    out = perturb(w, 9, 3, 0.125, "gauss8")
    z = direction(9, 3, 1001, "gauss8")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (w.float() + 0.125 * z).to(torch.bfloat16))


def test_replay_equals_successive_axpy():
    w0 = torch.randn(777, generator=torch.Generator().manual_seed(0))
    seeds, coeffs = [3, 1 << 63, 11], [0.5, -0.25, 1e-4]
    a = replay_(w0.clone(), seeds, coeffs, 50, "rademacher")
    b = w0.clone()
    for s, c in zip(seeds, coeffs):
        probe_kernels.axpy_(b, s, 50, c, "rademacher")
    assert torch.equal(a, b)


def test_model_variants_match_per_tensor_calls():
    ts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 130, 7)]
    offs = [0, 5, 135]
    outs = probe_kernels.perturb_model(ts, offs, 77, 0.5, "gauss8")
    flat = perturb(torch.cat(ts), 77, 0, 0.5, "gauss8")
    assert torch.equal(torch.cat(outs), flat)
    cl = [t.clone() for t in ts]
    probe_kernels.replay_model(cl, offs, [1, 2], [0.1, -0.2], "gauss8")
    assert torch.equal(torch.cat(cl), replay_(torch.cat(ts), [1, 2], [0.1, -0.2], 0, "gauss8"))


def test_clear_errors():
    with pytest.raises(TypeError, match="fp32 master"):
        probe_kernels.axpy_(torch.zeros(4, dtype=torch.bfloat16), 1, 0, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        perturb(torch.zeros(4, dtype=torch.int32), 1, 0, 1.0)
    with pytest.raises(ValueError, match="offset"):
        perturb(torch.zeros(4), 1, -1, 1.0)
    with pytest.raises(ValueError, match="unknown probe distribution"):
        direction(1, 0, 4, "uniform")
    with pytest.raises(ValueError, match="coeffs"):
        replay_(torch.zeros(4), [1, 2], [1.0], 0)
    with pytest.raises(ValueError, match="offsets"):
        probe_kernels.perturb_model([torch.zeros(3)], [0, 3], 1, 1.0)
