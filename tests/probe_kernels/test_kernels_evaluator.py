"""ProbeEvaluator: exact perturbed losses and bit-identical clean weights after many probes."""

import copy

import pytest
import torch

from probe_kernels import ProbeEvaluator, canonical_offsets, direction, perturb
from support.models import tiny_gpt2


def _loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.fixture(scope="module")
def setup():
    model = tiny_gpt2(vocab_size=256)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, batch


def test_offsets_follow_named_parameters_tied_once(setup):
    model, _ = setup
    rows = canonical_offsets(model)
    assert [n for n, _, _ in rows] == [n for n, _ in model.named_parameters()]
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, listed once
    acc = 0
    for _, p, o in rows:
        assert o == acc
        acc += p.numel()


@pytest.mark.parametrize("dist", ["gauss8", "rademacher"])
def test_probe_loss_equals_explicitly_perturbed_copy(setup, dist):
    model, batch = setup
    ev = ProbeEvaluator(model, _loss)
    try:
        for seed, alpha in [(3, 1e-2), ((1 << 63) + 9, -0.05)]:
            twin = copy.deepcopy(model)
            with torch.no_grad():
                for _, p, off in canonical_offsets(twin):
                    z = direction(seed, off, p.numel(), dist).view(p.shape)
                    p.copy_(p.float() + torch.tensor(alpha, dtype=torch.float32) * z)
                expect = float(_loss(twin, batch))
            assert ev.loss(batch, seed, alpha, dist) == expect
        with torch.no_grad():
            assert ev.clean_loss(batch) == float(_loss(model, batch))
    finally:
        ev.close()


def test_clean_weights_bit_identical_after_1000_probes(setup):
    model, batch = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ev = ProbeEvaluator(model, _loss)
    l0 = ev.clean_loss(batch)
    pairs = ev.losses(batch, seeds=range(500), alpha=1e-3)
    assert len(pairs) == 500 and all(lp != lm for lp, lm in pairs[:10])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), before[n].view(torch.int32)), n
    assert ev.clean_loss(batch) == l0
    ev.close()


def test_weights_restored_when_loss_raises(setup):
    model, batch = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def broken(m, b):
        m.transformer.wte(b)  # perturbs the tied embedding, then fails
        raise RuntimeError("boom")

    ev = ProbeEvaluator(model, broken)
    with pytest.raises(RuntimeError, match="boom"):
        ev.loss(batch, 5, 0.1)
    ev.close()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_perturb_of_param_matches_evaluator_scratch(setup):
    model, _ = setup
    _, p, off = canonical_offsets(model)[3]
    out = perturb(p.detach(), 11, off, 0.5)
    assert not torch.equal(out, p.detach())


def test_units_cover_every_parameter_and_tied_weight_is_shared(setup):
    model, _ = setup
    ev = ProbeEvaluator(model, _loss)
    seen: dict[int, int] = {}
    for _, ps in ev.units:
        for p in ps:
            seen[id(p)] = seen.get(id(p), 0) + 1
    assert set(seen) == {id(p) for p in model.parameters()}
    assert ev._shared == {id(model.transformer.wte.weight)}
    assert all(sum(p.numel() for p in ps) <= ev.budget for _, ps in ev.units)
    ev.close()


def test_small_budget_splits_units_and_gives_same_loss(setup):
    model, batch = setup
    big, small = ProbeEvaluator(model, _loss), ProbeEvaluator(model, _loss, budget=64)
    try:
        assert len(small.units) > len(big.units)
        assert small.loss(batch, 21, 0.02) == big.loss(batch, 21, 0.02)
    finally:
        big.close()
        small.close()


def test_prepared_unit_plans_follow_weight_updates_and_reallocation():
    """The evaluator prepares one launch plan per unit; in-place updates and replaced tensors (new storage,
    another dtype) must both be seen by the next probe, equal to a fresh evaluator's loss bit for bit."""
    model = tiny_gpt2(vocab_size=256)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    ev = ProbeEvaluator(model, _loss)
    try:
        first = ev.loss(batch, 11, 1e-2)
        assert ev.loss(batch, 11, 1e-2) == first  # reused plans give the same bits
        block = model.transformer.h[0]
        with torch.no_grad():
            block.mlp.c_fc.weight.add_(0.5)  # in place: same storage
        updated = ev.loss(batch, 11, 1e-2)
        fresh = ProbeEvaluator(model, _loss)
        assert updated == fresh.loss(batch, 11, 1e-2) != first
        fresh.close()
        block.attn.c_attn.weight.data = block.attn.c_attn.weight.data * 0.25  # new storage
        replaced = ev.loss(batch, 11, 1e-2)
        fresh = ProbeEvaluator(model, _loss)
        assert replaced == fresh.loss(batch, 11, 1e-2) != updated
        fresh.close()
    finally:
        ev.close()
