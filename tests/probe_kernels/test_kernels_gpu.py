"""Compiled Triton kernels on CUDA equal the PyTorch reference bit for bit (skipped without CUDA)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dist", ["gauss8", "rademacher"])
@pytest.mark.parametrize("scale", [1, 64])
def test_compiled_parity(scale, dist):
    from probe_kernels.parity import run_parity

    assert run_parity("cuda", scale, (dist,)) == []


@needs_cuda
@pytest.mark.parametrize("dist", ["gauss8", "rademacher"])
def test_large_direction_matches_reference(dist):
    from probe_kernels import direction

    n, off = 10_000_019, (1 << 33) + 5
    assert torch.equal(direction(123, off, n, dist, "cuda").cpu(), direction(123, off, n, dist, "cpu"))


@needs_cuda
def test_evaluator_on_cuda_matches_cpu_twin():
    from transformers import GPT2Config, GPT2LMHeadModel

    from probe_kernels import ProbeEvaluator

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    model = GPT2LMHeadModel(cfg).eval().cuda()
    batch = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    before = [p.detach().clone() for p in model.parameters()]
    ev = ProbeEvaluator(model, lambda m, b: m(input_ids=b, labels=b).loss)
    vals = [ev.loss(batch, s, 1e-2) for s in range(20)]
    assert len(set(vals)) > 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ev.close()
