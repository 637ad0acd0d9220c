"""Whole-model probe path (probe_kernels.fastpath) against the per-unit reference, on CPU: uncompiled, the two
evaluate the same eager code on bit-identical weights, so every loss must be equal bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from probe_kernels import ProbeEvaluator, WholeModelEvaluator, make_evaluator
from probe_kernels.fastpath import choose_mode, model_bytes


def lm_loss(model, batch):
    x, y = batch
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def tiny(dtype=torch.float32, seed=0):
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).to(dtype).eval()


def batch(seed=1):
    t = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_equals_per_unit_bit_for_bit_on_100_seeds(dtype):
    torch.set_num_threads(1)  # CPU reductions depend on the thread count; both paths run on this one
    model, b = tiny(dtype), batch()
    before = [p.detach().clone() for p in model.parameters()]
    ref = ProbeEvaluator(model, lm_loss)
    fast = WholeModelEvaluator(model, lm_loss, compile=False)
    assert fast.mode == "whole" and ref.mode == "per_unit" and not fast.compiled
    l0 = ref.clean_loss(b)
    assert fast.clean_loss(b) == l0
    for s in range(100):
        dist = "rademacher" if s % 3 == 0 else "gauss8"
        for alpha in (1e-2, -1e-2):
            assert fast.loss(b, s, alpha, dist) == ref.loss(b, s, alpha, dist), (s, alpha, dist)
    assert fast.clean_loss(b) == l0  # the scratch went back to the clean weights
    assert fast.losses(b, [3, 4], 1e-2) == ref.losses(b, [3, 4], 1e-2)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # clean weights never written
    ref.close()
    fast.close()


def test_loss_swapped_matches_between_paths_and_restores():
    model, b = tiny(), batch(2)
    ref, fast = ProbeEvaluator(model, lm_loss), WholeModelEvaluator(model, lm_loss, compile=False)
    params = [p for p in model.parameters()]
    new = {0: params[0].detach() * 1.01, 3: params[3].detach() + 0.02}
    assert fast.loss_swapped(b, new) == ref.loss_swapped(b, new) != ref.clean_loss(b)
    assert fast.loss_swapped(b, None) == ref.clean_loss(b)
    assert all(p.data_ptr() == q.data_ptr() for p, q in zip(params, model.parameters()))
    with pytest.raises(ValueError, match="block 0"):
        fast.loss_swapped(b, {0: params[0].detach()[:1]})


def test_tied_weights_are_perturbed_once_in_the_copy():
    model = tiny()
    fast = WholeModelEvaluator(model, lm_loss, compile=False)
    assert fast.shadow.lm_head.weight is fast.shadow.transformer.wte.weight
    assert fast.shadow.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()
    assert len(fast.scratch) == len(list(model.parameters()))


def test_choose_mode_and_make_evaluator_log_the_choice(caplog):
    gib = 1 << 30
    assert choose_mode(1 * gib, 10 * gib) == "whole"
    assert choose_mode(8 * gib, 10 * gib) == "per_unit"  # a quarter of free memory is kept for activations
    assert choose_mode(1 * gib, 2 * gib) == "per_unit"  # at least 2 GiB kept
    assert choose_mode(1 * gib, 2 * gib, reserve=0) == "whole"
    with pytest.raises(ValueError):
        choose_mode(-1, 1)
    model = tiny()
    assert model_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    with caplog.at_level(logging.INFO, logger="sparecycles.kernels"):
        ev = make_evaluator(model, lm_loss, reserve=0)
    assert ev.mode == "whole" and "probe path: whole" in caplog.text and "GB free" in caplog.text
    assert make_evaluator(model, lm_loss, mode="per_unit").mode == "per_unit"
    with pytest.raises(ValueError, match="mode"):
        make_evaluator(model, lm_loss, mode="fast")


def test_blocks_are_perturbed_when_the_embedding_outweighs_them():
    # vocab 4096 x 16 = 65,536-element embedding (the default unit budget) > both blocks' 6,656 together:
    # the ModuleList holding the blocks used to become one unit whose hooks never ran (blocks left clean)
    cfg = GPT2Config(vocab_size=4096, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).eval()
    ref = ProbeEvaluator(model, lm_loss)
    assert all(type(m).forward is not torch.nn.Module.forward for m, _ in ref.units)
    assert {id(p) for _, ps in ref.units for p in ps} == {id(p) for p in model.parameters()}
    t = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(3))
    b = (t[:, :-1], t[:, 1:])
    fast = WholeModelEvaluator(model, lm_loss, compile=False)
    assert [ref.loss(b, s, 1e-2) for s in range(5)] == [fast.loss(b, s, 1e-2) for s in range(5)]


def test_rebind_moves_the_copy_to_the_next_version():
    m0, m1, b = tiny(seed=0), tiny(seed=1), batch(4)
    fast = WholeModelEvaluator(m0, lm_loss, compile=False)
    fast.loss(b, 3, 1e-2)
    shadow = fast.shadow
    assert fast.rebind(m1) and fast.model is m1 and fast.shadow is shadow
    ref = ProbeEvaluator(m1, lm_loss)
    assert fast.loss(b, 3, 1e-2) == ref.loss(b, 3, 1e-2) and fast.clean_loss(b) == ref.clean_loss(b)
    assert not fast.rebind(tiny(torch.bfloat16))  # another dtype: a new copy is needed
    assert fast.model is m1


def test_padded_head_and_eager_masks_keep_the_losses():
    import sys

    model, b = tiny(), batch(5)  # vocab 96: padded to 128 rows
    ref = ProbeEvaluator(model, lm_loss)
    fast = WholeModelEvaluator(model, lm_loss, compile=False, pad_head=True, eager_masks=True)
    assert fast.padded_head and fast.shadow.lm_head.padded_weight.shape == (128, 32)
    assert fast.shadow.transformer.wte.weight is fast.shadow.lm_head.weight  # still tied, now a padded view
    assert [n for n, _ in fast.shadow.named_parameters()] == [n for n, _ in model.named_parameters()]
    mod = sys.modules[type(model).__module__]
    assert fast.eager_masks >= 0 and getattr(mod.create_causal_mask, "_eager_mask", False)
    for s in range(10):
        want, got = ref.loss(b, s, 1e-2), fast.loss(b, s, 1e-2)
        assert abs(want - got) <= 1e-5 * abs(want)
    assert fast.shadow.lm_head.padded_weight[96:].abs().sum() == 0  # the padding rows stay zero
    assert abs(fast.clean_loss(b) - ref.clean_loss(b)) <= 1e-5 * ref.clean_loss(b)
    m1 = tiny(seed=1)
    assert fast.rebind(m1)
    assert abs(fast.loss(b, 2, 1e-2) - ProbeEvaluator(m1, lm_loss).loss(b, 2, 1e-2)) <= 1e-5 * 5


def test_pipelined_losses_are_the_per_call_bits():
    torch.set_num_threads(1)
    model, b = tiny(torch.bfloat16), batch(6)
    fast = WholeModelEvaluator(model, lm_loss, compile=False)
    seeds = [0, 7, 2**64 - 1]
    want = [(fast.loss(b, s, 1e-2, "rademacher"), fast.loss(b, s, -1e-2, "rademacher")) for s in seeds]
    assert fast.losses(b, seeds, 1e-2, "rademacher") == want
    assert fast.losses(b, [], 1e-2) == [] and fast.losses(b, [3], 0.0) == [(fast.clean_loss(b),) * 2]
    assert fast.clean_loss(b) == ProbeEvaluator(model, lm_loss).clean_loss(b)  # the scratch was reset
    for bad in ([1.5], [-1], [2**64]):
        with pytest.raises((TypeError, ValueError)):
            fast.losses(b, bad, 1e-2)
