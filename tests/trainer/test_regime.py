"""Issue 29: role assignment on real decoder layouts, the static table, the calibrated block trust region
(hysteresis and clipping on a quadratic with known block spectra), group-line probes, the regime mode and the
linear-to-zero schedule."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainer.config import TrainConfig, lr_at
from trainer.zo.block_table import log_mean_multiplier, table_multipliers
from trainer.zo.group_line import group_line_losses, group_line_weights
from trainer.zo.groups import Role, model_roles
from trainer.zo.multipliers import WANG2025_MULTIPLIERS
from trainer.zo.trust_region import (
    DESIGN_ALPHAS,
    RoleFit,
    TrustRegion,
    TrustRegionRule,
    fit_role,
    next_streak,
)


def _numel(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ---- role assignment -------------------------------------------------------------------------------------
def test_gpt2_small_width_roles():
    """gpt2-small's layer shapes (D = 768, 12 heads; 2 layers to keep CI light): fused c_attn split at 2D."""
    torch.manual_seed(0)
    d, layers = 768, 2
    m = GPT2LMHeadModel(GPT2Config(n_embd=d, n_layer=layers, n_head=12, n_positions=1024, vocab_size=50257))
    g = model_roles(m)
    assert g.roles == (Role.EMBED, Role.QK, Role.VO, Role.FFN, Role.NORM)
    assert g.size(Role.EMBED) == 50257 * d + 1024 * d
    assert g.size(Role.QK) == layers * (d * 2 * d + 2 * d)
    assert g.size(Role.VO) == layers * (d * d + d + d * d + d)
    assert g.size(Role.FFN) == layers * (2 * d * 4 * d + 4 * d + d)
    assert g.size(Role.NORM) == (2 * layers + 1) * 2 * d
    assert sum(g.size(r) for r in g.roles) == _numel(m)


@pytest.mark.parametrize("tied", [True, False])
def test_smollm2_roles(tied):
    """SmolLM2-135M's config (D 576, 9 heads, 3 kv heads, FFN 1536, RMSNorm, tied), 2 of its 30 layers."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=tied)
    m = LlamaForCausalLM(cfg)
    g = model_roles(m)
    kv = 3 * 64
    assert g.size(Role.EMBED) == 49152 * 576
    assert g.size(Role.QK) == 2 * (576 * 576 + kv * 576)
    assert g.size(Role.VO) == 2 * (kv * 576 + 576 * 576)
    assert g.size(Role.FFN) == 2 * 3 * 576 * 1536
    assert g.size(Role.NORM) == (2 * 2 + 1) * 576
    assert (g.size(Role.HEAD) == 49152 * 576) == (not tied)
    assert sum(g.size(r) for r in g.roles) == _numel(m)
    assert all(s.dim is None for segs in g.groups.values() for s in segs)  # whole blocks: no fused tensors


def test_opt_and_qwen3_roles_cover_every_parameter():
    from transformers import OPTConfig, OPTForCausalLM, Qwen3Config, Qwen3ForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2, ffn_dim=16,
                                   num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=8))
    g = model_roles(opt)
    assert g.size(Role.FFN) == 2 * (8 * 16 + 16 + 16 * 8 + 8) and g.size(Role.VO) == 2 * 2 * (64 + 8)
    assert sum(g.size(r) for r in g.roles) == _numel(opt)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=8, num_hidden_layers=1, intermediate_size=16,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=4))
    g = model_roles(qwen)
    assert g.size(Role.NORM) == 3 * 8 + 2 * 4  # q_norm / k_norm (head_dim 4) are norms
    assert sum(g.size(r) for r in g.roles) == _numel(qwen)


# ---- the static table ------------------------------------------------------------------------------------
def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_table_normalisations():
    g = model_roles(_tiny_gpt2())
    raw = table_multipliers(g, norm="smallest")
    assert raw == {r: WANG2025_MULTIPLIERS[r.value] for r in g.roles}  # Norm = 1: the published table
    geo = table_multipliers(g)
    assert log_mean_multiplier(g, geo) == pytest.approx(1.0, rel=1e-12)
    for r in g.roles:  # the ratios are the table's
        assert geo[r] / geo[Role.NORM] == pytest.approx(WANG2025_MULTIPLIERS[r.value])
    n = {r: g.size(r) for r in g.roles}
    expect = math.exp(sum(n[r] * math.log(WANG2025_MULTIPLIERS[r.value]) for r in n) / sum(n.values()))
    assert geo[Role.EMBED] == pytest.approx(10.0 / expect)
    with pytest.raises(ValueError, match="qk"):
        table_multipliers(g, {"embed": 1.0})


# ---- the trust region on a quadratic with known block spectra ------------------------------------------------
def _quadratic_losses(h: float, m: float, eta: float, x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """(B, J) losses of L_b(y) = ½·h·‖y − c_b‖² at y = x_t + α·d with d the GD step −η·m·h·x from x (x_t = x + d)."""
    d = -eta * m * h * x
    rows = [[0.5 * h * float(((x + (1 + a) * d - c) ** 2).sum()) for a in DESIGN_ALPHAS] for c in centres]
    return torch.tensor(rows, dtype=torch.float64)


def test_trust_region_converges_to_the_known_block_optimum():
    """Block G's loss ½·h_G·‖y_G − c_b‖² (batch b shifts the centre by c_b ~ N(0, σ²)); the trainer's step on G is
    GD at η·m_G, so the best step along it is r = 1/(η·m_G·h_G) and the optimum multiplier m*_G = 1/(η·h_G)."""
    gen = torch.Generator().manual_seed(0)
    eta, n, batches = 0.1, 64, 6
    h = {"a": 5.0, "b": 1.0, "c": 0.4}  # m* = 2, 10, 25
    rule = TrustRegionRule(m_max=50.0)
    tr = TrustRegion({k: 1.0 for k in h}, rule)
    for _ in range(40):
        fits = {}
        for k, hk in h.items():
            x = torch.randn(n, generator=gen, dtype=torch.float64)
            centres = 0.05 * torch.randn(batches, n, generator=gen, dtype=torch.float64)
            fits[k] = fit_role(DESIGN_ALPHAS, _quadratic_losses(hk, tr.mult[k], eta, x, centres))
        tr.update(fits)
    for k, hk in h.items():
        assert tr.mult[k] == pytest.approx(1 / (eta * hk), rel=0.1), (k, tr.mult)


def test_trust_region_never_moves_on_evidence_below_the_threshold():
    rule = TrustRegionRule()
    tr = TrustRegion({"a": 2.0, "b": 1.0}, rule)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):  # |z| up to 2.99, either sign: never evidence
        z = float(torch.rand((), generator=gen)) * 5.98 - 2.99
        tr.update({"a": RoleFit(math.log(2.0) * math.copysign(1, z), 1.0, z, 6, ()),
                   "b": RoleFit(-0.5, 0.5 / abs(z), -abs(z), 6, ())})
    assert tr.mult == {"a": 2.0, "b": 1.0} and tr.streak == {"a": 0, "b": 0}
    strong = RoleFit(math.log(2.0), 0.01, 70.0, 6, ())
    flip = RoleFit(-math.log(2.0), 0.01, -70.0, 6, ())
    for fit in (strong, strong, flip, strong, strong, flip, strong, strong):  # never 3 in a row of one sign
        tr.update({"a": fit})
    assert tr.mult["a"] == 2.0 and tr.streak["a"] == 2
    tr.update({"a": strong})  # the third in a row: it moves, by 2^(1−β)
    assert tr.mult["a"] == pytest.approx(2.0 * 2 ** 0.5)


def test_trust_region_clips_each_refresh_and_bounds_the_multiplier():
    rule = TrustRegionRule(beta=0.5, agree=1, m_max=4.0, m_min=0.25)
    tr = TrustRegion({"a": 1.0, "b": 1.0}, rule)
    huge, tiny = RoleFit(math.log(1e6), 0.1, 1e3, 6, ()), RoleFit(math.log(1e-6), 0.1, -1e3, 6, ())
    tr.update({"a": huge, "b": tiny})
    assert tr.mult["a"] == pytest.approx(2 ** 0.5) and tr.mult["b"] == pytest.approx(2 ** -0.5)  # r clipped to [½, 2]
    for _ in range(20):
        tr.update({"a": huge, "b": tiny})
    assert tr.mult == {"a": 4.0, "b": 0.25}
    assert next_streak(-2, huge, 3.0) == 1 and next_streak(2, huge, 3.0) == 3 and next_streak(5, tiny, 3.0) == -1
    with pytest.raises(ValueError):
        TrustRegionRule(r_min=1.5)


def test_fit_role_statistics():
    """Exact quadratics: per-batch ratios 1 + α*; SE across batches; one batch has no SE."""
    rows = [[0.5 * (a - s) ** 2 for a in DESIGN_ALPHAS] for s in (0.2, 0.4, 0.6)]  # α* = s: r = 1.2, 1.4, 1.6
    f = fit_role(DESIGN_ALPHAS, rows)
    assert f.ratios == pytest.approx((1.2, 1.4, 1.6))
    y = torch.tensor([math.log(1.2), math.log(1.4), math.log(1.6)], dtype=torch.float64)
    assert f.log_ratio == pytest.approx(float(y.mean())) and f.se == pytest.approx(float(y.std()) / math.sqrt(3))
    assert f.z == pytest.approx(f.log_ratio / f.se)
    one = fit_role(DESIGN_ALPHAS, rows[:1])
    assert one.z == 0.0 and one.se == math.inf
    with pytest.raises(ValueError):
        fit_role(DESIGN_ALPHAS, [[1.0, 2.0]])


# ---- group-line probes ----------------------------------------------------------------------------------
def test_group_line_moves_only_the_role_and_reaches_prev_at_minus_one():
    m = _tiny_gpt2()
    g = model_roles(m)
    params = list(m.parameters())
    prev = [p.detach().float() + 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            for i, p in enumerate(params)]
    new = group_line_weights(params, prev, g, Role.QK, -1.0)
    ci = [i for i, (n, _) in enumerate(m.named_parameters()) if n == "transformer.h.0.attn.c_attn.weight"][0]
    assert torch.allclose(new[ci][:, :16], prev[ci][:, :16], atol=1e-6)  # QK columns back at θ_prev
    assert torch.equal(new[ci][:, 16:], params[ci].detach()[:, 16:])  # V columns untouched
    assert set(new) == {s.block for s in g.groups[Role.QK]}


def test_group_line_losses_clean_point_and_forward_count():
    m = _tiny_gpt2()
    g = model_roles(m)
    prev = [p.detach().float() * 0.99 for p in m.parameters()]
    batches = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(b)) for b in range(3)]

    def loss_fn(model, x):
        return model(input_ids=x, labels=x).loss

    losses, fwd = group_line_losses(m, loss_fn, batches, g, prev, DESIGN_ALPHAS)
    assert fwd == 3 * (1 + len(g.roles) * (len(DESIGN_ALPHAS) - 1))
    j0 = DESIGN_ALPHAS.index(0.0)
    with torch.no_grad():
        clean = [float(loss_fn(m, x)) for x in batches]
    for r in g.roles:
        assert losses[r][:, j0].tolist() == clean
    assert all(torch.equal(p.detach().float() * 0.99, q) for p, q in zip(m.parameters(), prev))  # untouched


def test_the_role_table_names_every_element_once():
    """GroupMap.probe_fields: the blocks and slices a round carries cover each role, and roles never overlap."""
    model = _tiny_gpt2()
    gmap = model_roles(model)
    seen = {i: torch.zeros(p.shape, dtype=torch.int64) for i, p in enumerate(model.parameters())}
    for role in gmap.roles:
        blocks, slices = gmap.probe_fields(role)
        cut = {s[0]: s for s in slices}
        for b in blocks:
            if b in cut:
                _, dim, start, stop = cut[b]
                seen[b].narrow(dim, start, stop - start).add_(1)
            else:
                seen[b].add_(1)
    assert all(bool((t == 1).all()) for t in seen.values())
    assert gmap.probe_fields(Role.QK)[1]  # c_attn's QK columns are slices


# ---- the mode -------------------------------------------------------------------------------------------
def _loss_fn(model, batch):
    """LM loss of a (B, T) token tensor, or of a 1-tuple of one (the held-out batches: tuples checkpoint)."""
    x = batch[0] if isinstance(batch, tuple) else batch
    return model(input_ids=x, labels=x).loss


def _mode(name: str, model, interval: int = 2, backend=None, timing: str = "async", **opts):
    """trainer.zo.modes.ZOCurvMode driving the method's rule (trainer.zo.regime_mode), held-out batches from
    `_counting`; `backend`: where the rounds run (None: in process)."""
    from trainer.methods import get_method
    from trainer.zo.modes import ZOCurvMode
    from trainer.zo.probes import canonical_blocks
    from trainer.zo.regime_mode import build_regime_rule

    cfg = TrainConfig(optimizer=name, steps=12, warmup_steps=1, curvature_interval=interval, lr=3e-3, probe_batch_size=2,
                      optimizer_options=opts)

    def source(refresh, b):
        return (_counting(2, 1000 * refresh + b),)

    blocks = canonical_blocks(model)
    groups = [{"params": [b.param for b in blocks if b.param.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [b.param for b in blocks if b.param.dim() < 2], "weight_decay": 0.0}]
    rule = build_regime_rule(groups, blocks, cfg, get_method(name).parse_options(opts), source)
    return ZOCurvMode(cfg, model, rule, _loss_fn, backend, timing)


def _counting(rows: int, seed: int) -> torch.Tensor:
    """Sequences counting up mod 32 from random starts: learnable, so the fitted steps agree across batches."""
    starts = torch.randint(0, 32, (rows, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(8)) % 32


def _batch(step):
    return _counting(4, step)


def test_static_mode_runs_at_the_table():
    mode = _mode("zocurv-static", _tiny_gpt2())
    assert mode.optimizer.mult == table_multipliers(mode.optimizer.gmap)
    stats = mode.step(0, _batch(0), 1e-3)
    assert stats["probe_forwards"] == 0 and stats["mult_embed"] == pytest.approx(mode.optimizer.mult[Role.EMBED])


def test_trust_mode_resumes_bit_for_bit():
    """Steps 0-6 straight equal steps 0-2, a checkpoint-like hand-over (weights, AdamW state, extra state with
    θ_prev), then steps 3-6 (refreshes at 0, 3, 6: the resumed run's first fit needs the restored θ_prev)."""
    opts = {"start": "one", "agree": 1, "z_min": 0.1, "batches": 2}
    a = _mode("zocurv-trust", _tiny_gpt2(), interval=3, **opts)
    for s in range(7):
        a.step(s, _batch(s), 3e-3)
    b = _mode("zocurv-trust", _tiny_gpt2(), interval=3, **opts)
    for s in range(3):
        b.step(s, _batch(s), 3e-3)
    tensors, meta = b.extra_state()
    c = _mode("zocurv-trust", _tiny_gpt2(), interval=3, **opts)
    c.model.load_state_dict(b.model.state_dict())
    c.optimizer.load_state_dict(b.optimizer.state_dict())
    c.load_extra_state(tensors, meta)
    for s in range(3, 7):
        c.step(s, _batch(s), 3e-3)
    assert a.optimizer.mult == c.optimizer.mult and a.optimizer.mult != {r: 1.0 for r in a.optimizer.gmap.roles}
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))


def test_trust_rounds_fold_late_without_waiting_and_checkpoint_each_batch_once():
    """A backend that answers a refresh's rounds one refresh late (InProcessBackend.delay_rounds: a fleet's async
    timing): no step waits, the refresh's B·R group_line rounds fold whole at the next refresh with the fits an
    at-once backend makes at their own; rounds in flight checkpoint each held-out batch once (safetensors refuses
    tensors sharing memory) and restore sharing it."""
    from safetensors.torch import save

    from trainer.zo.backend import InProcessBackend
    from trainer.zo.rounds import RoundBook

    opts = {"start": "one", "agree": 1, "z_min": 0.1, "batches": 2}
    now = _mode("zocurv-trust", _tiny_gpt2(), **opts)
    model = _tiny_gpt2()
    rounds_per_refresh = 2 * len(now.optimizer.gmap.roles)
    late = _mode("zocurv-trust", model, backend=InProcessBackend(model, _loss_fn, history=2,
                                                                  delay_rounds=rounds_per_refresh), **opts)
    logs_now = [now.step(s, _batch(s), 3e-3) for s in range(5)]
    logs_late = []
    for s in range(5):
        logs_late.append(late.step(s, _batch(s), 3e-3))
        if s == 2:  # refresh 2's rounds are in flight
            assert "tr_version" not in logs_late[2] and logs_late[2]["trust_pending_rounds"] == rounds_per_refresh
            tensors, meta = late.extra_state()
            held = sorted(k for k in tensors if k.startswith("round/"))
            assert len(held) == 2 and len(meta["curvature"]["inflight"]) == rounds_per_refresh  # 2 batches, once
            save(tensors)
            book = RoundBook(0)
            book.load_state(tensors, meta["curvature"])
            assert len({id(r.batch) for r in book.inflight()}) == 2
    assert logs_now[2]["tr_version"] == 2.0 and logs_late[4]["tr_version"] == 2.0  # folded one refresh late
    fitted = [k for k in logs_now[2] if k.startswith("tr_")]
    assert len(fitted) == 1 + 3 * len(now.optimizer.gmap.roles)
    assert {k: logs_late[4][k] for k in fitted if not k.startswith("tr_streak")} == {
        k: logs_now[2][k] for k in fitted if not k.startswith("tr_streak")}  # the same fits, folded late


# ---- the schedule ----------------------------------------------------------------------------------------
def test_linear_schedule_decays_to_zero_and_cosine_is_unchanged():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(5, **kw, schedule="linear") == lr_at(5, **kw) == pytest.approx(0.6)
    assert lr_at(60, **kw, schedule="linear") == pytest.approx(0.5)
    assert lr_at(109, **kw, schedule="linear") == pytest.approx(0.01)
    assert lr_at(110, **kw, schedule="linear") == 0.0
    assert lr_at(60, **kw) == pytest.approx(0.55)
    with pytest.raises(ValueError):
        lr_at(0, **kw, schedule="step")
    assert "schedule" not in TrainConfig().run_json()  # folders from before the field resume
    assert TrainConfig(schedule="linear").run_json()["schedule"] == "linear"


def test_a_runs_summary_counts_every_round_books_skipped_rounds():
    """summary.json's rounds_skipped reads every round book's counters (trainer.zo.rounds: <prefix>_dropped_rounds,
    <prefix>_pending_rounds), the trust region's `trust_` as zocurv-line's `line_` and the others' `curv_`: the last
    record that carries them wins; a run without rounds has none."""
    from trainer.train_report import rounds_summary as _rounds_summary

    recs = [{"step": 1, "trust_dropped_rounds": 3.0, "trust_pending_rounds": 5.0, "loss": 2.0},
            {"step": 2, "loss": 1.9}, {"step": 3, "trust_dropped_rounds": 90.0, "trust_pending_rounds": 0.0}]
    assert _rounds_summary(recs) == {"dropped": 90.0, "pending_at_end": 0.0}
    assert _rounds_summary([{"step": 1, "line_dropped_rounds": 2.0}]) == {"dropped": 2.0}
    assert _rounds_summary([{"step": 1, "loss": 2.0}]) == {}
