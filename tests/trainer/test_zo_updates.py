"""The pure update rules of trainer.zo.updates: AdamW against torch.optim.AdamW bit for bit, Sophia's clip
invariants against its closed form, and the multiplier helpers' bounds."""

from __future__ import annotations

import pytest
import torch

from trainer.zo import updates as upd


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_update_is_torch_adamw_bit_for_bit(weight_decay):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (11,), (3, 4, 2)]
    params = [torch.randn(s, generator=g) for s in shapes]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    lr, betas, eps = 3e-3, (0.9, 0.95), 1e-8
    opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for t in range(1, 7):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for q, gr in zip(ref, grads):
            q.grad = gr.clone()
        opt.step()
        for p, gr, (m, v) in zip(params, grads, moments):
            upd.adamw_update_(p, gr, m, v, step=float(t), hp=upd.AdamWHyper(lr, betas[0], betas[1], eps, weight_decay))
        for p, q, (m, v) in zip(params, ref, moments):
            assert torch.equal(p, q.detach())
            assert torch.equal(m, opt.state[q]["exp_avg"]) and torch.equal(v, opt.state[q]["exp_avg_sq"])


def test_adamw_lr_scale_scales_only_the_step():
    # First step: m̂ = g and v̂ = g², so θ1 = θ0·(1 − lr·wd) − lr·s·g/(|g| + eps) in closed form.
    g = torch.Generator().manual_seed(1)
    theta, grad = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    lr, wd, s, eps = 1e-2, 0.1, 2.5, 1e-8
    p = theta.clone()
    upd.adamw_update_(p, grad, torch.zeros_like(p), torch.zeros_like(p), step=1,
                      hp=upd.AdamWHyper(lr, 0.9, 0.95, eps, wd), lr_scale=s)
    torch.testing.assert_close(p, theta * (1 - lr * wd) - lr * s * grad / (grad.abs() + eps), rtol=1e-12, atol=1e-15)


def test_sophia_clip_invariants():
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1000, generator=g, dtype=torch.float64)
    d = torch.randn(1000, generator=g, dtype=torch.float64)  # mixed signs: non-positive curvature included
    gamma, eps = 0.05, 1e-12
    direction, clipped = upd.sophia_clip(m, d, gamma, eps)
    assert float(direction.abs().max()) <= 1.0  # the step never exceeds lr per coordinate
    assert torch.equal(torch.sign(direction), torch.sign(m))  # the clip never flips a direction
    ratio = m / torch.clamp(gamma * d, min=eps)
    free = ratio.abs() < 1
    assert torch.equal(direction[free], ratio[free])  # unclipped entries are the Newton-like ratio itself
    assert torch.equal(direction[d <= 0], torch.sign(m[d <= 0]))  # no curvature: sign(m) (|m| >> eps here)
    assert clipped == int((~free).sum()) and 0 < clipped < m.numel()


def test_sophia_update_is_decay_then_clipped_step():
    g = torch.Generator().manual_seed(3)
    theta, grad = torch.randn(40, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64)
    m0, d = torch.randn(40, generator=g, dtype=torch.float64), torch.rand(40, generator=g, dtype=torch.float64)
    lr, b1, gamma, eps, wd = 1e-2, 0.965, 0.5, 1e-12, 0.1
    p, m = theta.clone(), m0.clone()
    clipped = upd.sophia_update_(p, grad, m, d, lr=lr, beta1=b1, gamma=gamma, eps=eps, weight_decay=wd)
    m_expected = b1 * m0 + (1 - b1) * grad
    torch.testing.assert_close(m, m_expected, rtol=1e-12, atol=1e-15)
    ratio = m_expected / torch.clamp(gamma * d, min=eps)
    torch.testing.assert_close(p, theta * (1 - lr * wd) - lr * ratio.clamp(-1, 1), rtol=1e-12, atol=1e-15)
    assert clipped == int((ratio.abs() >= 1).sum())


def test_multipliers_stay_in_their_bounds():
    f64 = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    s = upd.block_multipliers(f64(1e-9, 1.0, 1e9, -3.0, 0.0), None, 0.5, 2.0)
    assert float(s.min()) >= 0.5 and float(s.max()) <= 2.0
    torch.testing.assert_close(s, f64(2.0, 1.0, 0.5, 2.0, 2.0))  # ρ = median of the positives = 1
    torch.testing.assert_close(upd.block_multipliers(f64(-1.0, 0.0), None, 0.5, 2.0), f64(1.0, 1.0))
    target = upd.line_multipliers(f64(1.0, 3.0, 0.3), f64(2.0, 2.0, 0.5), 0.25, 4.0)
    torch.testing.assert_close(target, f64(2.0, 4.0, 0.25))
    assert upd.clipped_fraction(target, 0.25, 4.0) == pytest.approx(2 / 3)


def test_decoupled_decay_touches_matrices_only():
    w, b = torch.ones(3, 2), torch.ones(2)
    upd.decoupled_decay_([w, b], lr=0.1, weight_decay=0.5)
    assert torch.equal(w, torch.full((3, 2), 0.95)) and torch.equal(b, torch.ones(2))
