"""ZO-Curv second generation (issue 17): role groups, multipliers, quadratic fits, ZOCurvRoleAdamW, the mode."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainer.config import TrainConfig
from trainer.mode_builders import build_mode
from trainer.zo.backend import InProcessBackend
from trainer.zo.groups import Role, assign_roles, block_multipliers, model_roles
from trainer.zo.multipliers import (
    WANG2025_MULTIPLIERS,
    CurvEstimate,
    group_curvature,
    line_ratio,
    quadratic_fit,
    sharpness_multipliers,
    update_global_multiplier,
    update_group_multipliers,
)
from trainer.zo.probes import canonical_blocks, group_weights, swapped_loss
from trainer.zo.role_rules import RoleRounds, ZOCurvRoleAdamW, group_estimates
from trainer.zo.rounds import RoundBook

D, L = 8, 2


def tiny_gpt2(tied: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=D, n_layer=L, n_head=2, tie_word_embeddings=tied,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # SmolLM2's layout (GQA, SwiGLU, RMSNorm, tied embeddings) at toy width
    cfg = LlamaConfig(vocab_size=32, hidden_size=D, intermediate_size=16, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


# ---- group assignment -------------------------------------------------------------------------
def test_gpt2_roles_split_c_attn_and_cover_every_element():
    m = tiny_gpt2()
    g = model_roles(m)
    assert g.roles == (Role.EMBED, Role.QK, Role.VO, Role.FFN, Role.NORM)  # tied head: it is wte
    assert g.size(Role.EMBED) == 32 * D + 16 * D
    assert g.size(Role.QK) == L * (D * 2 * D + 2 * D)
    assert g.size(Role.VO) == L * (D * D + D + D * D + D)  # V columns of c_attn + attn.c_proj
    assert g.size(Role.FFN) == L * (D * 4 * D + 4 * D + 4 * D * D + D)
    assert g.size(Role.NORM) == (2 * L + 1) * 2 * D
    assert sum(g.size(r) for r in g.roles) == sum(p.numel() for p in m.parameters())
    qk = [s for s in g.groups[Role.QK] if s.name.endswith("c_attn.weight")][0]
    assert (qk.dim, qk.start, qk.stop) == (1, 0, 2 * D)


def test_gpt2_qk_columns_are_query_and_key():
    """Zeroing c_attn's V columns zeroes the attention's value path only: the attention output becomes 0,
    while zeroing the QK columns leaves a uniform causal average of values (not 0)."""
    m = tiny_gpt2().eval()
    attn = m.transformer.h[0].attn
    g = model_roles(m)
    x = torch.randn(1, 5, D)
    for role in (Role.VO, Role.QK):
        seg = [s for s in g.groups[role] if s.name == "transformer.h.0.attn.c_attn.weight"][0]
        bseg = [s for s in g.groups[role] if s.name == "transformer.h.0.attn.c_attn.bias"][0]
        with torch.no_grad():
            w, b = attn.c_attn.weight.clone(), attn.c_attn.bias.clone()
            attn.c_attn.weight[seg.mask()] = 0.0
            attn.c_attn.bias[bseg.mask()] = 0.0
            attn.c_proj.bias.zero_()
            out = attn(x)[0]
            attn.c_attn.weight.copy_(w)
            attn.c_attn.bias.copy_(b)
        assert bool((out == 0).all()) == (role is Role.VO)


@pytest.mark.parametrize("tied", [True, False])
def test_llama_roles(tied):
    m = tiny_llama(tied)
    g = model_roles(m)
    kv = 2 * (D // 4)  # 2 kv heads of head_dim 2
    assert g.size(Role.QK) == L * (D * D + kv * D)
    assert g.size(Role.VO) == L * (kv * D + D * D)
    assert g.size(Role.FFN) == L * 3 * D * 16
    assert g.size(Role.NORM) == (2 * L + 1) * D
    assert g.size(Role.EMBED) == 32 * D
    assert (Role.HEAD in g.roles) == (not tied)
    assert sum(g.size(r) for r in g.roles) == sum(p.numel() for p in m.parameters())


def test_role_rounds_perturb_exactly_their_role():
    """A role's ``group`` round moves exactly the role's elements: a Llama role is whole blocks (the plain group
    kind); GPT-2's c_attn is split by column slices, its other columns bit-identical to θ."""
    from trainer.zo.role_rules import role_round

    for m in (tiny_llama(tied=False), tiny_gpt2()):
        g = model_roles(m)
        blocks = canonical_blocks(m)
        for role in g.roles:
            r = role_round(g, role, round_id="r", version=0, batch=None, eps=0.03, seeds=(11,))
            moved = group_weights(blocks, r.blocks, 11, -0.03, "rademacher", r.slices)
            whole = group_weights(blocks, r.blocks, 11, -0.03, "rademacher")
            for seg in g.groups[role]:
                w, mask = blocks[seg.block].param.detach(), seg.mask()
                if mask is None:
                    assert torch.equal(moved[seg.block], whole[seg.block])
                else:
                    assert torch.equal(moved[seg.block][mask], whole[seg.block][mask])
                    assert torch.equal(moved[seg.block][~mask], w[~mask])
            assert sum(int((moved[b] != blocks[b].param.detach()).sum()) for b in moved) == g.size(role)


def _group_refresh(m, quad, g, *, probes=3, eps_rel=2.0**-4, seed=7):
    """One refresh of zocurv-group's rounds on `m` through InProcessBackend: (estimates, eps stats, forwards)."""
    blocks = [b.param for b in canonical_blocks(m)]
    opt = ZOCurvRoleAdamW([{"params": blocks}], blocks=blocks, gmap=g, options=None, rounds=RoleRounds(
        group_probes=True, probe_budget=1 + 2 * probes * len(g.roles), probe_eps=eps_rel, interval=1, seed=seed))
    be, book = InProcessBackend(m, quad), RoundBook(2)
    book.issue(be, opt.make_rounds(None, 0, ()))
    book.collect(be)
    (done,) = book.due(0)
    est, eps = group_estimates(done, g)
    return est, eps, be.forward_passes


def test_unknown_names_and_bad_c_attn_raise():
    with pytest.raises(ValueError, match="cannot place parameter .encoder.layer.0.weird.weight. in a block role"):
        assign_roles([("encoder.layer.0.weird.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="Conv1D"):
        assign_roles([("h.0.attn.c_attn.weight", torch.zeros(4, 8))])


def test_block_multipliers_broadcast_c_attn_columns():
    m = tiny_gpt2()
    g = model_roles(m)
    mult = block_multipliers(g, {Role.QK: 8.0, Role.VO: 4.0, Role.FFN: 6.0, Role.EMBED: 10.0})
    names = [n for n, _ in m.named_parameters()]
    w = mult[names.index("transformer.h.1.attn.c_attn.weight")]
    assert w.shape == (1, 3 * D) and w[0, : 2 * D].eq(8).all() and w[0, 2 * D:].eq(4).all()
    assert mult[names.index("transformer.h.1.attn.c_attn.bias")].shape == (3 * D,)
    assert mult[names.index("transformer.ln_f.weight")] == 1.0  # norm not given: base lr
    assert mult[names.index("transformer.wte.weight")] == 10.0


# ---- multipliers from exact curvature --------------------------------------------------------------
def _role_quadratic(means):
    """tiny GPT-2 at θ = 0.5 and L(θ) = ½ Σ_i d_i θ_i² with d_i = mean_role · u_i, u_i ~ U[0.5, 1.5) per element
    (negative means give a concave group). Rademacher probes restricted to G give h = Σ_{i∈G} d_i exactly
    (z_i² = 1), so S_G = mean d over G with zero standard error; θ, ε and z are exactly representable, so
    the finite differences are exact to float64 rounding. Returns (model, role map, loss, exact S_G)."""
    m = tiny_gpt2()
    g = model_roles(m)
    params = list(m.parameters())
    gen = torch.Generator().manual_seed(1)
    d = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for role, segs in g.groups.items():
        for seg in segs:
            vals = means[role] * (0.5 + torch.rand(seg.shape, generator=gen, dtype=torch.float64))
            mask = seg.mask()
            d[seg.block] = torch.where(mask, vals, d[seg.block]) if mask is not None else vals
    with torch.no_grad():
        for p in params:
            p.fill_(0.5)

    def quad(model, batch):
        return sum(0.5 * (di * q.double() ** 2).sum() for di, q in zip(d, model.parameters()))

    exact = {role: float(sum((d[s.block][s.mask()] if s.mask() is not None else d[s.block]).sum()
                             for s in g.groups[role])) / g.size(role) for role in g.roles}
    return m, g, quad, exact


def test_multipliers_from_exact_curvature_of_a_quadratic_with_known_block_spectra():
    means = {Role.EMBED: 0.01, Role.QK: 0.5, Role.VO: 2.0, Role.FFN: 1.0, Role.NORM: 50.0}
    m, g, quad, exact = _role_quadratic(means)
    est, _, fwd = _group_refresh(m, quad, g)
    assert fwd == 1 + 2 * 3 * len(g.roles)
    for role in g.roles:
        assert est[role].mean == pytest.approx(exact[role], rel=1e-9)
        assert est[role].se == pytest.approx(0.0, abs=1e-9 * exact[role])
    s = update_group_multipliers({}, est, gamma=0.5, s_max=10.0, beta=0.0, snr_min=2.0)
    top = max(e.mean for e in est.values())
    for role in g.roles:
        assert s[role] == pytest.approx(min(max(math.sqrt(top / est[role].mean), 1.0), 10.0))
    assert s[Role.NORM] == 1.0 and s[Role.EMBED] == 10.0  # sharpest keeps lr; the flattest is clipped


def test_a_concave_group_keeps_its_multiplier_and_never_rises_to_s_max():
    """FFN concave (mean d = −1) with the probes' exact, zero-variance estimate (|SNR| = inf): by default it is
    skipped (keeps its multiplier, refresh after refresh), the other groups follow s_G = clip(√(S_max/S_G), 1,
    s_max) over the convex groups alone; the old "flat" rule drives it to s_max by the EMA:
    s_k = s_max − (s_max − s_0)·β^k."""
    means = {Role.EMBED: 0.01, Role.QK: 0.5, Role.VO: 2.0, Role.FFN: -1.0, Role.NORM: 50.0}
    m, g, quad, exact = _role_quadratic(means)
    assert exact[Role.FFN] < 0
    est, _, _ = _group_refresh(m, quad, g)
    assert est[Role.FFN].mean == pytest.approx(exact[Role.FFN], rel=1e-9)
    assert est[Role.FFN].snr < -1e6  # trusted: confidently negative
    top = exact[Role.NORM]
    skip = flat = {r: 1.0 for r in g.roles} | {Role.FFN: 1.5}
    for k in range(1, 5):
        skip = update_group_multipliers(skip, est, gamma=0.5, s_max=10.0, beta=0.5)
        flat = update_group_multipliers(flat, est, gamma=0.5, s_max=10.0, beta=0.5, negative="flat")
        assert skip[Role.FFN] == 1.5
        assert flat[Role.FFN] == pytest.approx(10.0 - (10.0 - 1.5) * 0.5**k)
        for role in (Role.EMBED, Role.QK, Role.VO, Role.NORM):
            target = min(max(math.sqrt(top / exact[role]), 1.0), 10.0)
            assert skip[role] == pytest.approx(flat[role]) == pytest.approx(target - (target - 1.0) * 0.5**k)
    assert skip[Role.NORM] == 1.0 and skip[Role.EMBED] == pytest.approx(10.0 - 9.0 * 0.5**4)  # 70x clipped


def test_group_curvature_statistics():
    e = group_curvature([2.0, 4.0, 6.0], n=2)
    assert e.mean == 2.0 and e.se == pytest.approx(2.0 / math.sqrt(3) / 2) and e.snr == pytest.approx(2 * math.sqrt(3))
    assert group_curvature([1.0], 1).snr == 0.0
    with pytest.raises(ValueError):
        group_curvature([math.nan, 1.0], 1)


@pytest.mark.parametrize("seed", range(5))
def test_multipliers_upward_only_and_clipped(seed):
    gen = torch.Generator().manual_seed(seed)
    s = {i: float(v) for i, v in enumerate(torch.randn(6, generator=gen).exp() * 10 ** torch.randn(6, generator=gen))}
    s[6] = -1.0
    out = sharpness_multipliers(s, gamma=0.7, s_max=5.0)
    assert all(1.0 <= v <= 5.0 for v in out.values())
    top = max(k for k in s if s[k] == max(s.values()))
    assert out[top] == 1.0 and out[6] == 5.0
    order = sorted((k for k in s if s[k] > 0), key=lambda k: s[k])
    assert all(out[a] >= out[b] for a, b in zip(order, order[1:]))  # flatter -> larger
    est = {k: CurvEstimate(v, 1.0, v if k != 2 else 0.1) for k, v in s.items()}
    prev = {k: 1.0 + k / 2 for k in s}
    upd = update_group_multipliers(prev, est, gamma=0.7, s_max=5.0, beta=0.5, snr_min=0.5)
    assert all(1.0 <= v <= 5.0 for v in upd.values())
    assert upd[2] == prev[2]  # untrusted (|SNR| < snr_min): unchanged
    m = 1.0
    for r in (0.1, 3.0, 3.0, 3.0, 0.2, 10.0):
        m2 = update_global_multiplier(m, r, m_max=4.0, beta=0.3)
        assert 1.0 <= m2 <= 4.0
        m = m2
    assert sharpness_multipliers({0: -1.0, 1: 0.0}) == {0: 1.0, 1: 1.0}


def test_negative_curvature_policy():
    est = {"a": CurvEstimate(4.0, 0.1, 40.0), "b": CurvEstimate(1.0, 0.1, 10.0), "c": CurvEstimate(-1.0, 0.1, -10.0)}
    flat = update_group_multipliers({}, est, gamma=0.5, s_max=8.0, beta=0.0, negative="flat")
    skip = update_group_multipliers({"c": 1.5}, est, gamma=0.5, s_max=8.0, beta=0.0)  # the default
    assert flat == {"a": 1.0, "b": 2.0, "c": 8.0}
    assert skip == {"a": 1.0, "b": 2.0, "c": 1.5}
    with pytest.raises(ValueError):
        update_group_multipliers({}, est, negative="up")


def test_wang_table_is_upward_only():
    assert min(WANG2025_MULTIPLIERS.values()) == 1.0 and WANG2025_MULTIPLIERS["embed"] == 10.0


# ---- quadratic fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("c,b,a", [(3.0, -0.4, 0.8), (5.0, 0.3, 2.0), (1.0, -0.2, -0.5)])
def test_quadratic_fit_is_exact_on_quadratics(c, b, a):
    al = [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5]
    f = quadratic_fit(al, [c + b * x + 0.5 * a * x * x for x in al])
    assert (f.c, f.b, f.a) == pytest.approx((c, b, a), abs=1e-12)
    assert f.se_a == pytest.approx(0.0, abs=1e-9) and f.rss == pytest.approx(0.0, abs=1e-20)
    three = quadratic_fit(al[:3], [c + b * x + 0.5 * a * x * x for x in al[:3]])
    assert three.a == pytest.approx(a) and math.isnan(three.se_a)
    if a > 0:
        assert f.argmin == pytest.approx(-b / a)
        assert line_ratio(f, 0.5, 2.0) == pytest.approx(min(max(1 - b / a, 0.5), 2.0))
    else:
        assert line_ratio(f, 0.5, 2.0) == (2.0 if b < 0 else 0.5)
    with pytest.raises(ValueError):
        quadratic_fit([0.0, 0.0, 1.0], [1.0, 1.0, 2.0])


@torch.no_grad()
def line_losses(model, loss_fn, batch, prev, alphas):
    """Reference: L(θ_t + α·(θ_t − θ_prev)) for each α, each block rounded once to its dtype, swapped in for the
    forward (α = 0: the clean weights); prev: fp32 copies of the canonical blocks at θ_{t−k}."""
    blocks = canonical_blocks(model)
    out = []
    for a in alphas:
        new = {i: (b.param.detach().float() + a * (b.param.detach().float() - q)).to(b.param.dtype)
               for i, (b, q) in enumerate(zip(blocks, prev))} if a else {}
        out.append(swapped_loss(model, blocks, loss_fn, batch, new))
    return out


def test_line_losses_trace_the_displacement():
    m = tiny_gpt2()
    prev = [p.detach().float().clone() for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.25)

    def quad(model, batch):
        return sum((q.double() ** 2).sum() for q in model.parameters())

    got = line_losses(m, quad, None, prev, [-1.0, 0.0, 1.0])
    ref = [float(sum(((q + (1 + a) * 0.25).double() ** 2).sum() for q in prev)) for a in (-1.0, 0.0, 1.0)]
    assert got == pytest.approx(ref, rel=1e-6)


# ---- ZOCurvRoleAdamW -------------------------------------------------------------------------------
def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_role_adamw_matches_torch_adamw_with_per_group_lrs():
    a, b = tiny_gpt2(), tiny_gpt2()
    names = [n for n, _ in a.named_parameters()]
    blocks = list(a.parameters())
    opt = ZOCurvRoleAdamW([{"params": blocks, "weight_decay": 0.1}], lr=1e-2, blocks=blocks, gmap=model_roles(a),
                          options=None, rounds=RoleRounds(probe_budget=3, probe_eps=1e-3, interval=1, seed=0))
    mult = [1.0] * len(blocks)
    for i, n in enumerate(names):
        mult[i] = 3.0 if "mlp" in n else 1.0
    opt.block_mult, opt.global_mult = mult, 2.0
    pb = list(b.parameters())
    ref = torch.optim.AdamW([{"params": [p for p, s in zip(pb, mult) if s == 1.0], "lr": 2e-2},
                             {"params": [p for p, s in zip(pb, mult) if s != 1.0], "lr": 6e-2}],
                            betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        ref.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---- the mode ------------------------------------------------------------------------------------
def _lm_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(input_ids=x).logits.reshape(-1, 32), y.reshape(-1))


@pytest.mark.parametrize("name", ["zocurv-group", "zocurv-global", "zocurv-group-global", "zocurv-group-fixed"])
def test_role_mode_steps_logs_and_resumes(name):
    cfg = TrainConfig(model="gpt2-tiny", optimizer=name, lr=1e-3, steps=6, warmup_steps=1, curvature_interval=2,
                      probe_budget=21, probe_batch_size=2, eps=1e-2, batch_size=2, seq_len=8)
    mode = build_mode(cfg, tiny_gpt2(), _lm_loss)
    gen = torch.Generator().manual_seed(0)
    logs = []
    for step in range(5):
        x = torch.randint(0, 32, (2, 9), generator=gen)
        logs.append(mode.step(step, (x[:, :-1], x[:, 1:]), 1e-3))
    assert all(math.isfinite(r["loss"]) for r in logs)
    if name == "zocurv-group-fixed":
        assert logs[0]["mult_qk"] == 8.0 and logs[-1]["probe_forwards"] == 0
    if name in ("zocurv-group", "zocurv-group-global"):
        assert mode.optimizer.per_role == 2 and logs[0]["probe_forwards"] == 1 + 2 * 2 * 5
        assert {"snr_qk", "curv_norm", "mult_ffn"} <= set(logs[2])
    if "global" in name:
        assert "line_snr" in logs[2] and "line_snr" not in logs[0]  # the first refresh has no θ_{t−k}
    assert all(1.0 <= r[k] <= 10.0 for r in logs for k in r if k.startswith("mult_"))
    tensors, meta = mode.extra_state()
    other = build_mode(cfg, tiny_gpt2(), _lm_loss)
    other.load_extra_state(tensors, meta)
    assert other.optimizer.mult == mode.optimizer.mult and other.optimizer.global_mult == mode.optimizer.global_mult
    assert sorted(other.backend.snapshots) == ([4] if 'global' in name else [])  # θ at the last refresh


def test_role_options_come_from_the_registry():
    from pydantic import ValidationError

    cfg = TrainConfig(model="gpt2-tiny", optimizer="zocurv-group", optimizer_options={"s_max": 3.0, "negative": "flat"})
    opts = build_mode(cfg, tiny_gpt2(), _lm_loss).optimizer.opts
    assert (opts.s_max, opts.negative, opts.gamma) == (3.0, "flat", 0.5)
    cfg = TrainConfig(model="gpt2-tiny", optimizer="zocurv-group")
    assert build_mode(cfg, tiny_gpt2(), _lm_loss).optimizer.opts.negative == "skip"
    with pytest.raises(ValidationError):
        TrainConfig(model="gpt2-tiny", optimizer="zocurv-global", optimizer_options={"s_maximum": 3.0})


def test_line_round_gives_line_losses_bit_for_bit():
    """zocurv-global's ``line`` probe round (seeds 1, 2, 3 at ε = ½ with L0), the one fleet workers evaluate, gives
    the losses of `line_losses` (the reference: θ_t + α·d loaded and evaluated) at LINE_ALPHAS exactly."""
    from trainer.zo.backend import collect_round
    from trainer.zo.probes import ProbeKind, RoundSpec
    from trainer.zo.role_rules import LINE_ALPHAS, LINE_EPS, LINE_SEEDS, line_fit_losses

    m = tiny_gpt2()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (2, 9), generator=gen)
    batch = (x[:, :-1], x[:, 1:])
    be = InProcessBackend(m, _lm_loss, history=2)
    be.publish(0)
    prev = [p.detach().float().clone() for p in m.parameters()]
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-2)
    be.publish(5)
    res, counts = collect_round(be, RoundSpec("g", 5, batch, LINE_EPS, LINE_SEEDS, want_clean=True,
                                              kind=ProbeKind.LINE, base_version=0))
    assert counts["accepted"] == 3 and be.forward_passes == 1 + 2 * 3
    assert line_fit_losses({r.seed: r for r in res}) == line_losses(m, _lm_loss, batch, prev, LINE_ALPHAS)
    with pytest.raises(ValueError, match="step multiples"):
        collect_round(be, RoundSpec("h", 5, batch, LINE_EPS, (0,), kind=ProbeKind.LINE, base_version=0))
    with pytest.raises(ValueError, match="base_version"):
        RoundSpec("i", 5, batch, LINE_EPS, (1,), kind=ProbeKind.LINE)
