"""Teacher-round throughput on one device (issue 36): a teacher's plain bf16 forward vs what a teacher worker does
per round (probe_worker/teacher.py: compiled forward, trainer.kd.targets.make_targets on the device, the
wire.kd_targets blob), tokens/s each, the blob's bytes, and the determinism the fleet's parity rests on (the same
logits give the same sampled ids twice on the device; top-k on the device equals top-k on the CPU).

    python -m experiments.kd.teacher --preset gpt2-small --device cuda:0 --out experiments/kd/results/teacher_gpt2small.json

The teacher's weights are a seeded init (--config: SmolLM2-135M's architecture without its weights): throughput does not depend on them. Redis is not in the loop.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from trainer.kd.targets import make_targets
from trainer.models import build_model
from wire.kd_targets import encode


def _rate(fn, tokens: int, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return tokens * iters / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    """Measure and write the JSON (tokens/s: plain eager bf16 forward, compiled forward, a whole round)."""
    p = argparse.ArgumentParser(prog="python -m experiments.kd.teacher", description=__doc__)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--config", type=Path, default=None, help="a transformers config.json (e.g. SmolLM2-135M's): "
                   "that architecture, seeded random weights, instead of --preset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.config is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.config.parent), dtype=dtype)
        model = model.to(a.device).eval().requires_grad_(False)
    else:
        model = build_model(a.preset, seed=0, dtype=dtype, device=a.device).eval().requires_grad_(False)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    x = torch.randint(0, vocab, (a.batch_size, a.seq_len), generator=torch.Generator().manual_seed(0)).to(a.device)
    tokens = x.numel()
    compiled = torch.compile(model) if cuda else model
    with torch.no_grad():
        plain = _rate(lambda: model(input_ids=x).logits, tokens, a.iters, sync)
        fast = _rate(lambda: compiled(input_ids=x).logits, tokens, a.iters, sync)
        blob_len = [0]

        def round_() -> None:
            z = compiled(input_ids=x).logits
            t = make_targets(z, kind="sampled", k=a.k, temperature=1.0, seed=0, step=1, rank=0)
            blob_len[0] = len(encode(t))

        whole = _rate(round_, tokens, a.iters, sync)
        z = compiled(input_ids=x).logits
        s1 = make_targets(z, kind="sampled", k=a.k, temperature=1.0, seed=0, step=1, rank=0)
        s2 = make_targets(z, kind="sampled", k=a.k, temperature=1.0, seed=0, step=1, rank=0)
        t_dev = make_targets(z, kind="topk", k=a.k, temperature=1.0, seed=0, step=1, rank=0)
        t_cpu = make_targets(z.cpu(), kind="topk", k=a.k, temperature=1.0, seed=0, step=1, rank=0)
    res = {
        "preset": a.preset if a.config is None else f"{a.config.parent.name} architecture (seeded init)",
        "params": sum(p.numel() for p in model.parameters()), "device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": str(dtype),
        "batch": [a.batch_size, a.seq_len], "k": a.k, "iters": a.iters, "vocab": vocab,
        "tokens_per_s": {"plain_forward": round(plain), "compiled_forward": round(fast),
                         "teacher_round": round(whole)},
        "round_vs_plain": round(whole / plain, 3),
        "blob_bytes": blob_len[0], "ids_bytes_up": 4 * tokens,
        "sampled_ids_repeat_equal": bool(torch.equal(s1.ids, s2.ids)),
        "topk_device_equals_cpu": bool(torch.equal(t_dev.ids, t_cpu.ids)),
        "topk_logp_max_abs_diff": float((t_dev.logp - t_cpu.logp).abs().max()),
        "torch": torch.__version__,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
