"""probe_kernels.FastForward on CPU (uncompiled): the copy runs the model's exact code, so its outputs equal the model's
own bit for bit, in the model's dtype and, cast to bf16, those of a bf16 copy; `load` moves it to another version
of the same architecture (cast on the way) and refuses another architecture. The compiled CUDA path is
tests/probe_kernels/test_fastpath_gpu.py's."""

from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from probe_kernels import FastForward, WholeModelEvaluator, lm_logits
from trainer.models.losses import lm_batch_loss


def tiny(seed=0, n_embd=32):
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=n_embd, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).eval()


def batch(seed=1):
    t = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


@torch.no_grad()
def test_fast_forward_equals_the_model_bit_for_bit_and_loads_versions():
    torch.set_num_threads(1)
    model, b = tiny(), batch()
    ff = FastForward(model, lm_batch_loss, compile=False)
    assert not ff.compiled and ff.dtype is None
    assert torch.equal(ff(b), lm_batch_loss(model, b))
    other = tiny(seed=7)
    assert ff.load(other)
    assert torch.equal(ff(b), lm_batch_loss(other, b))
    assert not torch.equal(ff(b), lm_batch_loss(model, b))  # it really moved
    assert not ff.load(tiny(n_embd=16))  # another architecture: refused, nothing changed
    assert torch.equal(ff(b), lm_batch_loss(other, b))


@torch.no_grad()
def test_bf16_fast_forward_equals_a_bf16_copy_and_leaves_the_model():
    torch.set_num_threads(1)
    model, b = tiny(), batch()
    before = [p.detach().clone() for p in model.parameters()]
    ff = FastForward(model, lm_logits, dtype=torch.bfloat16, compile=False)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    logits = ff(b[0])
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 12, 96)
    assert torch.equal(logits, ref(input_ids=b[0]).logits)
    assert all(p.dtype == torch.float32 and torch.equal(p, q) for p, q in zip(model.parameters(), before))
    other = tiny(seed=3)
    assert ff.load(other)  # fp32 weights cast into the bf16 copy
    assert torch.equal(ff(b[0]), copy.deepcopy(other).to(torch.bfloat16)(input_ids=b[0]).logits)


@torch.no_grad()
def test_whole_model_evaluator_runs_on_its_fast_forward():
    model, b = tiny(), batch()
    ev = WholeModelEvaluator(model, lm_batch_loss, compile=False)
    assert ev.fwd.shadow is ev.shadow and not ev.compiled and ev.compile_seconds is None
    assert ev.clean_loss(b) == float(lm_batch_loss(model, b))
