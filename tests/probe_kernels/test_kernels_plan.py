"""probe_kernels.ModelPlan on the reference path (CPU): same bits as the per-call list API, and checked inputs.
The Triton path of plans is covered by probe_kernels.parity (interpreter in CI, compiled on the GPU)."""

import pytest
import torch

from probe_kernels import ModelPlan, perturb_model, replay_model

SIZES = [5, 130, 1, 64]


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _offsets(start=17):
    offs = []
    for n in SIZES:
        offs.append(start)
        start += n
    return offs


@pytest.mark.parametrize("dist", ["gauss8", "rademacher"])
def test_plan_equals_list_api(dist):
    ws, offs = _tensors(torch.bfloat16), _offsets()
    plan = ModelPlan(ws, offs, dist)
    for seed, alpha in ((1, 1e-2), ((1 << 64) - 1, -0.3)):
        want = perturb_model(ws, offs, seed, alpha, dist)
        got = plan.perturb(seed, alpha)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))
    masters, ref = _tensors(), _tensors()
    seeds, coeffs = [7, 1 << 63, 12], [0.5, -2e-3, 1.0]
    ModelPlan(masters, offs, dist, outs=masters).replay_(seeds, coeffs)
    replay_model(ref, offs, seeds, coeffs, dist)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(masters, ref))


def test_plan_rejects_bad_lists():
    ws, offs = _tensors(), _offsets()
    with pytest.raises(ValueError, match="offsets"):
        ModelPlan(ws, offs[:-1])
    with pytest.raises(ValueError, match="outs"):
        ModelPlan(ws, offs, outs=[torch.empty(n + 1) for n in SIZES])
    with pytest.raises(TypeError):
        ModelPlan([w.to(torch.int32) for w in ws], offs)
    with pytest.raises(ValueError):
        ModelPlan(ws, [-1, *offs[1:]])
    with pytest.raises(ValueError):
        ModelPlan(ws, offs, "uniform")
    with pytest.raises(TypeError, match="fp32 master"):
        ModelPlan(_tensors(torch.bfloat16), offs).replay_([1], [1.0])
    with pytest.raises(ValueError):
        ModelPlan(ws, offs).perturb(-5, 1.0)


def test_plan_rejects_what_the_gpu_path_would_refuse():
    """Inputs the Triton path refuses are refused on every device, at construction (a fresh user's findings)."""
    ws, offs = _tensors(), _offsets()
    with pytest.raises(TypeError, match="offset must be an int"):
        ModelPlan(ws, [1.7, *offs[1:]])
    with pytest.raises(ValueError, match="contiguous"):
        ModelPlan([torch.zeros(4, 2).t(), *ws[1:]], offs)
    with pytest.raises(ValueError, match="4 tensors but 3 outs"):
        ModelPlan(ws, offs, outs=ws[:3])
    with pytest.raises(TypeError):
        ModelPlan(ws, offs, outs=["x"] * 4)
    with pytest.raises(TypeError, match="int64"):
        ModelPlan(ws, offs, outs=ws).replay_(torch.tensor([1.7, 2.2]), [0.1, 0.2])
