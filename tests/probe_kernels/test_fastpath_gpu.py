"""The whole-model probe path on CUDA (skipped without a GPU): uncompiled it equals the per-unit reference bit
for bit; compiled (torch.compile, Inductor's deterministic mode) it agrees within the tolerance stated in
probe_kernels/NOTES.md on 100 seeds and is deterministic (same seed -> same bits, also after a recompile)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from probe_kernels import ProbeEvaluator, WholeModelEvaluator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# |L_fast - L_ref| <= RTOL * |L_ref|; measured on gpt2-small bf16 (probe_kernels/NOTES.md): 1.4e-5 at most
RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}


def lm_loss(model, batch):
    x, y = batch
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def setup(dtype):
    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
    model = model.to(device="cuda", dtype=dtype).eval()
    t = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1)).cuda()
    return model, (t[:, :-1].contiguous(), t[:, 1:].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_eager_equals_per_unit_on_cuda(dtype):
    model, b = setup(dtype)
    ref, whole = ProbeEvaluator(model, lm_loss), WholeModelEvaluator(model, lm_loss, compile=False)
    assert whole.clean_loss(b) == ref.clean_loss(b)
    for s in range(100):
        assert whole.loss(b, s, 1e-2) == ref.loss(b, s, 1e-2), s


def test_compiled_whole_model_within_tolerance_and_deterministic():
    dtype = torch.bfloat16
    model, b = setup(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    ref = ProbeEvaluator(model, lm_loss)
    fast = WholeModelEvaluator(model, lm_loss)  # compiles on CUDA by default
    assert fast.compiled
    l0, r0 = fast.clean_loss(b), ref.clean_loss(b)
    assert abs(l0 - r0) <= RTOL[dtype] * abs(r0)
    vals = []
    for s in range(100):
        for a in (1e-2, -1e-2):
            v, r = fast.loss(b, s, a), ref.loss(b, s, a)
            assert abs(v - r) <= RTOL[dtype] * abs(r), (s, a, v, r)
            vals.append(v)
    assert len(set(vals)) > 100
    assert [fast.loss(b, s, a) for s in range(10) for a in (1e-2, -1e-2)] == vals[:20]  # same bits again
    assert fast.clean_loss(b) == l0
    again = WholeModelEvaluator(model, lm_loss)  # a second compile of the same model gives the same kernels
    assert [again.loss(b, s, a) for s in range(5) for a in (1e-2, -1e-2)] == vals[:10]
    assert all(torch.equal(x, p) for x, p in zip(before, model.parameters()))


def test_cuda_graphs_path_matches_compiled():
    model, b = setup(torch.bfloat16)
    plain = WholeModelEvaluator(model, lm_loss)
    graphs = WholeModelEvaluator(model, lm_loss, cuda_graphs=True)
    assert graphs.cuda_graphs
    want = [plain.loss(b, s, 1e-2) for s in range(10)]
    got = [graphs.loss(b, s, 1e-2) for s in range(10)]
    assert max(abs(x - y) for x, y in zip(want, got)) <= RTOL[torch.bfloat16] * abs(want[0])
    assert [graphs.loss(b, s, 1e-2) for s in range(10)] == got


def test_bf16_fast_forward_compiled_on_cuda_within_tolerance_of_a_bf16_copy():
    """The worker's eval / teacher forward (probe_kernels.FastForward, bf16 copy of fp32 weights, compiled): within the
    bf16 compiled tolerance of the eager bf16 copy, deterministic, and `load` moves it to another version."""
    from probe_kernels import FastForward, lm_logits

    model, b = setup(torch.float32)
    ff = FastForward(model, lm_loss, dtype=torch.bfloat16)
    assert ff.compiled and ff.dtype == torch.bfloat16
    eager = WholeModelEvaluator(copy.deepcopy(model).to(torch.bfloat16), lm_loss, compile=False)
    want = eager.clean_loss(b)
    got = float(ff(b))
    assert abs(got - want) <= RTOL[torch.bfloat16] * abs(want)
    assert float(ff(b)) == got  # same bits again
    other, _ = setup(torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.01)
    assert ff.load(other)
    moved = float(ff(b))
    assert moved != got
    logits = FastForward(model, lm_logits, dtype=torch.bfloat16)(b[0])
    assert logits.dtype == torch.bfloat16 and logits.shape == (*b[0].shape, 512)


def test_bf16_attention_on_fp32_weights_within_tolerance():
    """fp32 weights with bf16 attention (attn_dtype): the weights and the perturbation stay fp32; the loss is within
    the bf16 tolerance of the fp32 one, and the copy's perturbed losses keep their seed dependence."""
    model, b = setup(torch.float32)
    ref = WholeModelEvaluator(model, lm_loss)
    mixed = WholeModelEvaluator(model, lm_loss, attn_dtype=torch.bfloat16)
    assert mixed.fwd.attn_dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in mixed.shadow.parameters())
    for s in range(4):
        r, m = ref.loss(b, s, 1e-2), mixed.loss(b, s, 1e-2)
        assert abs(r - m) <= RTOL[torch.bfloat16] * abs(r), (s, r, m)
    assert ref.clean_loss(b) == WholeModelEvaluator(model, lm_loss).clean_loss(b)  # unmarked copies unchanged
