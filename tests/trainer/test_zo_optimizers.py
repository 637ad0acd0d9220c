"""ZO-Curv optimizers on a quadratic with known H: exact-curvature steps vs hand-computed references."""

from __future__ import annotations

import pytest
import torch

from probe_kernels import direction, dist_moments
from support.quadratic import QuadraticModel, quad_loss
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.method_options import BlockOptions, LineOptions
from trainer.zo import estimators as est
from trainer.zo.backend import InProcessBackend
from trainer.zo.modes import refresh
from trainer.zo.optimizers import Probing, ZOCurvBlockAdamW, ZOCurvLine, ZOCurvSophia
from trainer.zo.rounds import RoundBook
from trainer.zo.updates import block_multipliers, line_ratios

SIZES = [6, 10, 3]
BOUNDS = [0, 6, 16, 19]


def _backward(model: QuadraticModel) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    model().backward()
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])


def _block_means(v: torch.Tensor) -> torch.Tensor:
    return torch.stack([v[BOUNDS[i]:BOUNDS[i + 1]].mean() for i in range(len(SIZES))])


def test_block_adamw_without_curvature_is_torch_adamw_bit_for_bit():
    a, b = QuadraticModel(SIZES, seed=1), QuadraticModel(SIZES, seed=1)
    opt_a = ZOCurvBlockAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(5):
        _backward(a), _backward(b)
        opt_a.step(), opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_block_adamw_with_exact_curvature_matches_formula():
    model = QuadraticModel(SIZES, seed=2)
    theta0 = model.theta()
    lr, wd, s_min, s_max = 1e-2, 0.1, 0.5, 2.0
    opt = ZOCurvBlockAdamW(model.parameters(), lr=lr, weight_decay=wd,
                           options=BlockOptions(s_min=s_min, s_max=s_max))
    d = _block_means(torch.diagonal(model.h))  # exact tr(H_bb)/n_b
    opt.curv.fold(d)
    grad = _backward(model)
    opt.step()
    s = (d.median() / d).clamp(s_min, s_max)  # ρ = median of the D_b
    s_elem = s.repeat_interleave(torch.tensor(SIZES))
    # First Adam step: m̂ = g, v̂ = g², so the step is lr·s_b·g/(|g| + eps).
    expected = theta0 * (1 - lr * wd) - lr * s_elem * grad / (grad.abs() + 1e-8)
    torch.testing.assert_close(model.theta(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(block_multipliers(torch.tensor([1.0, 4.0, -1.0], dtype=torch.float64), 2.0, 0.5, 3.0),
                               torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("granularity", ["block", "coordinate"])
def test_sophia_with_exact_curvature_matches_formula(granularity):
    model = QuadraticModel(SIZES, seed=3)
    theta0 = model.theta()
    lr, wd, b1, gamma = 1e-2, 0.1, 0.965, 0.05
    opt = ZOCurvSophia(model.parameters(), lr=lr, betas=(b1, 0.99), gamma=gamma, weight_decay=wd,
                       granularity=granularity)
    diag = torch.diagonal(model.h)
    d = _block_means(diag) if granularity == "block" else diag
    opt.curv.fold(d)
    grad = _backward(model)
    opt.step()
    d_elem = d.repeat_interleave(torch.tensor(SIZES)) if granularity == "block" else d
    ratio = (1 - b1) * grad / torch.clamp(gamma * d_elem, min=1e-12)
    expected = theta0 * (1 - lr * wd) - lr * ratio.clamp(-1, 1)
    torch.testing.assert_close(model.theta(), expected, rtol=1e-6, atol=1e-7)
    assert opt.last_clipped_frac == pytest.approx(float((ratio.abs() >= 1).double().mean()))


def test_block_refresh_folds_the_block_trace_estimate_of_exact_probe_curvatures():
    model = QuadraticModel(SIZES, seed=4)
    be = InProcessBackend(model, quad_loss)
    opt = ZOCurvBlockAdamW(model.parameters(), options=BlockOptions(curv_beta=0.5),
                           probing=Probing(probes=6, probe_eps=1e-2, seed=9))
    stats = refresh(opt, RoundBook(2), be, None, 0)
    r = opt.make_rounds(None, 0, ())[0]
    z = torch.stack([est.block_scaled_direction(s, BOUNDS[:-1], SIZES) for s in r.seeds]).double()
    h = torch.einsum("ki,ij,kj->k", z, model.h, z)  # exact zᵀHz
    a = torch.stack([est.block_scales(s, 3) for s in r.seeds])
    m2, m4 = dist_moments("gauss8")
    expected = est.block_trace_estimate(h, a, est.leave_one_out_mean(h), m2, m4) / torch.tensor(SIZES)
    torch.testing.assert_close(opt.curv.estimate, expected, rtol=2e-3, atol=2e-3)
    assert stats["curv_accepted"] == 6 and stats["curv_stale"] == 0
    assert stats["h_mean"] == pytest.approx(float(h.mean()), rel=1e-3)


def test_stale_rounds_dropped_and_counted_end_to_end():
    model = QuadraticModel(SIZES, seed=5)
    late = InProcessBackend(model, quad_loss, delay_rounds=2, staleness=1)  # results arrive two versions late
    opt, book = ZOCurvBlockAdamW(model.parameters(), probing=Probing(probes=2)), RoundBook(staleness=1)
    for v in range(5):
        stats = refresh(opt, book, late, None, v)
    assert not opt.curv.ready
    assert stats["curv_stale"] == 6 and stats["curv_accepted"] == 0  # rounds 0..2 delivered, all stale
    assert stats["curv_dropped_rounds"] == 3
    ok, book = ZOCurvBlockAdamW(model.parameters(), probing=Probing(probes=2)), RoundBook(staleness=2)
    for v in range(5):
        stats = refresh(ok, book, InProcessBackend(model, quad_loss), None, v)
    assert ok.curv.updates == 5 and stats["curv_stale"] == 0


def test_line_multiplier_is_clipped_newton_ratio_along_the_step():
    model = QuadraticModel(SIZES, seed=6)
    be = InProcessBackend(model, quad_loss, history=2)
    opt = ZOCurvLine(model.parameters(), lr=0.05, weight_decay=0.0, probe_eps=1e-2,
                     options=LineOptions(curv_beta=0.0, r_min=0.1, r_max=10.0, s_min=0.01, s_max=100.0))
    be.publish(0)
    theta0 = model.theta()
    _backward(model)
    opt.step()
    be.publish(1)
    theta1 = model.theta()
    refresh(opt, RoundBook(2), be, None, 1)
    grad1 = model.grad_at(theta1)
    expected = []
    for i in range(3):
        u = torch.zeros(19, dtype=torch.float64)
        u[BOUNDS[i]:BOUNDS[i + 1]] = (theta1 - theta0)[BOUNDS[i]:BOUNDS[i + 1]]
        # Exact minimiser along u from θ0's block: t* = 1 − ∇L(θ1)ᵀu / uᵀHu (in units of the step taken).
        expected.append(1 - float(grad1 @ u) / float(u @ model.h @ u))
    torch.testing.assert_close(opt.curv.estimate, torch.tensor(expected, dtype=torch.float64).clamp(0.1, 10),
                               rtol=2e-3, atol=2e-3)
    def f64(*x):
        return torch.tensor(x, dtype=torch.float64)
    r = line_ratios(f64(-1.0, 1.0, -1.0, 1.0), f64(1.0, 1.0, -1.0, -1.0), f64(0.5, 0.5, 0.5, 0.0), 0.5, 2.0)
    torch.testing.assert_close(r, torch.tensor([2.0, 0.5, 2.0, 1.0], dtype=torch.float64))


def test_bf16_masters_stay_fp32_through_checkpoint(tmp_path):
    model = QuadraticModel(SIZES, seed=7, dtype=torch.bfloat16)
    opt = ZOCurvBlockAdamW(model.parameters(), lr=1e-3)
    opt.curv.fold(torch.tensor([1.0, 2.0, 3.0]))
    for _ in range(3):
        _backward(model)
        opt.step()
    masters = [opt.state[p]["master"] for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # sub-bf16 progress kept
    tensors, meta = opt.zo_state()
    save_checkpoint(tmp_path / "c.safetensors", model=model, optimizer=opt, step=3, meta={"mode": meta},
                    extra=tensors)
    model2 = QuadraticModel(SIZES, seed=7, dtype=torch.bfloat16)  # same H, b; parameters reset below
    with torch.no_grad():
        for q in model2.parameters():
            q.zero_()
    opt2 = ZOCurvBlockAdamW(model2.parameters(), lr=1e-3)
    _, meta2, extra = load_checkpoint(tmp_path / "c.safetensors", model=model2, optimizer=opt2)
    opt2.load_zo_state(extra, meta2["mode"])
    for p, q in zip(model.parameters(), model2.parameters()):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    torch.testing.assert_close(opt2.curv.estimate, opt.curv.estimate, rtol=0, atol=0)
    for m in (model, model2):
        _backward(m)
    opt.step(), opt2.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_sophia_coordinate_refresh_folds_the_diagonal_estimate():
    model = QuadraticModel(SIZES, seed=9)
    opt = ZOCurvSophia(model.parameters(), granularity="coordinate",
                       probing=Probing(probes=5, probe_eps=1e-2, seed=4))
    refresh(opt, RoundBook(2), InProcessBackend(model, quad_loss), None, 0)
    r = opt.make_rounds(None, 0, ())[0]
    assert r.distribution == "gauss8"
    z = torch.stack([direction(s, 0, 19, "gauss8") for s in r.seeds]).double()
    h = torch.einsum("ki,ij,kj->k", z, model.h, z)
    m2, m4 = dist_moments("gauss8")
    expected = est.diag_estimate(h, z, est.leave_one_out_mean(h), m2, m4)
    torch.testing.assert_close(opt.curv.estimate, expected, rtol=2e-3, atol=2e-3)
