"""The worker's device path on CUDA (skipped without a GPU): weights loaded from shard tensors onto the GPU
and the worker's probe arithmetic give bit-identical losses to InProcessBackend on the same GPU, in fp32
and in bf16 (the usual inference-fleet dtype)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from fleet.publisher import manifest_config
from probe_kernels import ProbeEvaluator
from probe_worker.cache import build_from_tensors
from support.models import tiny_gpt2
from trainer.models.params import param_order_hash
from trainer.train import lm_loss
from trainer.zo import probes
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import ProbeKind, RoundSpec
from wire.messages import ShardRef, VersionManifest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def loss_fn(model, batch):
    return lm_loss(model, batch[0], batch[1])


def _model(dtype: torch.dtype) -> GPT2LMHeadModel:
    return tiny_gpt2(vocab_size=512, n_embd=128, n_head=4).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worker_probe_path_on_cuda_matches_in_process(dtype):
    model = _model(dtype)
    ref = InProcessBackend(model, loss_fn, history=2)
    ref.publish(0)
    snap0 = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.05)
    ref.publish(1)
    snap1 = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]

    def loaded(version, tensors):
        manifest = VersionManifest(
            run="gpu", version=version, shards=[ShardRef(name="s", sha256="0" * 64, bytes=1)],
            param_order_hash=param_order_hash(model), dtype=name, model_class="GPT2LMHeadModel",
            model_config_json=manifest_config(model))
        m = build_from_tensors(manifest, tensors, "cuda")
        assert all(p.device.type == "cuda" and p.dtype == dtype for p in m.parameters())
        return m

    w0, w1 = loaded(0, snap0), loaded(1, snap1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (4, 33), generator=g)
    batch = (tokens[:, :-1].cuda(), tokens[:, 1:].cuda())
    params1, params0 = probes.canonical_blocks(w1), probes.canonical_blocks(w0)

    def wloss(new):
        return probes.swapped_loss(w1, params1, loss_fn, batch, new)

    ev = ProbeEvaluator(w1, loss_fn)
    # the worker's site (probe_worker.runtime): blocks of the loaded version, u_b from the loaded base
    site = probes.ProbeSite(params1, wloss, lambda s, a, d: ev.loss(batch, s, a, d),
                            lambda b: params1[b].param.detach().float() - params0[b].param.detach().float())
    fc = [n for n, _ in model.named_parameters()].index("transformer.h.1.mlp.c_fc.weight")
    rounds = [RoundSpec("s", 1, batch, 1e-2, (3, 4), "gauss8", want_clean=True),
              RoundSpec("b", 1, batch, 1e-2, (5, 6), want_clean=True, kind=ProbeKind.BLOCK_SCALED),
              RoundSpec("a", 1, batch, 1e-2, (0, fc), want_clean=True, kind=ProbeKind.ALONG_UPDATE, base_version=0),
              RoundSpec("g", 1, batch, 1e-2, (7,), "gauss8", want_clean=True, kind=ProbeKind.GROUP, blocks=(1, fc))]
    for rnd in rounds:
        ref.submit(rnd)
        for r in ref.collect(rnd.round_id).results:
            worker = probes.probe_losses(site, rnd.kind, r.seed, rnd.eps, rnd.distribution, rnd.blocks, ev.clean_loss(batch))
            assert worker == (r.l_plus, r.l_minus, r.scale)
            assert ev.clean_loss(batch) == r.l0
    moved = probes.probe_losses(site, ProbeKind.ALONG_UPDATE, fc, 1e-2, "rademacher")
    assert moved[2] > 0 and moved[0] != moved[1]  # the probe really ran along the moved block
