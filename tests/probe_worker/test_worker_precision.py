"""probe_worker.runtime's precision plumbing on CPU (the CUDA-only choice of bf16, trainer.zo.probes.forward_dtype, is
passed in explicitly here; on the GPU it is exercised by `bench fleet --kind eval`): a bf16 kind probes a bf16 copy of
the loaded version, one copy kept; fp32 and bf16 evaluators live side by side (no recompile when kinds alternate) and
rebind to the next version; the eval rounds' FastForward reloads only when what it holds changes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from probe_worker.runtime import ForwardSettings, ProbeRuntime
from trainer.models.losses import lm_batch_loss


def tiny(seed=0):
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg).eval()


def runtime():
    return ProbeRuntime(None, "w", SimpleNamespace(device="cpu"),  # type: ignore[arg-type]
                        forwards=ForwardSettings(probe_path="whole", compile=False))


@torch.no_grad()
def test_bf16_copy_and_evaluators_per_dtype():
    rt, v1, v2 = runtime(), tiny(0), tiny(1)
    assert rt._cast(v1, None) is v1
    c1 = rt._cast(v1, torch.bfloat16)
    assert c1 is not v1 and next(c1.parameters()).dtype == torch.bfloat16 and rt._cast(v1, torch.bfloat16) is c1
    assert next(v1.parameters()).dtype == torch.float32  # the loaded version is untouched
    e32, e16 = rt._evaluator(v1, lm_batch_loss), rt._evaluator(c1, lm_batch_loss)
    assert e32 is not e16 and rt._evaluator(v1, lm_batch_loss) is e32 and rt._evaluator(c1, lm_batch_loss) is e16
    c2 = rt._cast(v2, torch.bfloat16)
    assert rt._evaluator(c2, lm_batch_loss) is e16 and e16.model is c2  # rebound, not rebuilt
    t = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    b = (t[:, :-1], t[:, 1:])
    assert e16.clean_loss(b) == float(lm_batch_loss(c2, b))


@torch.no_grad()
def test_eval_fast_forward_reloads_only_on_new_weights():
    rt, v1, v2 = runtime(), tiny(0), tiny(1)
    t = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    b = (t[:, :-1], t[:, 1:])
    ff = rt._fast_forward(v1, ("r", ((0, 1.0),), id(v1)), torch.bfloat16)
    want1 = float(lm_batch_loss(tiny(0).to(torch.bfloat16), b))
    assert float(ff(b)) == want1
    assert rt._fast_forward(v1, ("r", ((0, 1.0),), id(v1)), torch.bfloat16) is ff
    again = rt._fast_forward(v2, ("r", ((1, 1.0),), id(v2)), torch.bfloat16)
    assert again is ff and float(ff(b)) == float(lm_batch_loss(tiny(1).to(torch.bfloat16), b))


def test_attention_dtype_auto_is_fp32_on_cpu_and_bf16_on_cuda():
    """--tf32-attention auto keeps a CPU worker's attention fp32 (its losses equal the trainer's bit for bit) and
    runs bf16 attention on CUDA; fp32/bf16 are taken as given; anything else is refused."""
    import pytest
    import torch

    from probe_worker.assembly import attention_dtype

    assert attention_dtype("auto", "cpu") is None
    assert attention_dtype("auto", "cuda:0") is torch.bfloat16
    assert attention_dtype("fp32", "cuda:0") is None
    assert attention_dtype("bf16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="auto, fp32 or bf16"):
        attention_dtype("fp16", "cpu")
