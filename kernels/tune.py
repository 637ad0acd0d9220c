"""Measure (elements per program, warps) options of the single-launch list kernels on this GPU.

``python -m kernels.tune [--preset gpt2-small]`` prints, per kernel, the median time of each option over the
preset's parameter sizes; copy the best into triton_kernels.TUNING. Needs CUDA and triton.
"""

from __future__ import annotations

import argparse

import torch

from kernels import triton_kernels as tk
from kernels.bench import _ms, preset_sizes
from kernels.dist import ProbeDist
from kernels.ops import perturb_model, replay_model

OPTIONS = [(2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--k", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sizes = preset_sizes(args.preset)
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    gen = torch.Generator(device=dev).manual_seed(0)
    w16 = [torch.randn(s, device=dev, generator=gen).to(torch.bfloat16) for s in sizes]
    o16 = [torch.empty_like(w) for w in w16]
    w32 = [torch.randn(s, device=dev, generator=gen) for s in sizes]
    seeds = torch.arange(1, args.k + 1, dtype=torch.int64, device=dev) * 7919
    coeffs = torch.full((args.k,), 1e-6, device=dev)
    cases = {
        ("perturb", 2, "gauss8"): lambda d: perturb_model(w16, offs, 3, 1e-3, d, outs=o16),
        ("perturb", 4, "gauss8"): lambda d: perturb_model(w32, offs, 3, 1e-7, d, outs=w32),
        ("replay", 4, "gauss8"): lambda d: replay_model(w32, offs, seeds, coeffs, d),
        ("replay", 4, "rademacher"): lambda d: replay_model(w32, offs, seeds, coeffs, d),
    }
    print(f"{args.preset}: {sum(sizes) / 1e6:.1f}M params; median ms per option (block, warps)")
    for (kind, esize, dist), fn in cases.items():
        row = []
        for block, warps in OPTIONS:
            tk.TUNING[(kind, esize)] = (block, warps)
            tk._packed_cache.clear()
            row.append(f"{block}/{warps}: {_ms(lambda: fn(ProbeDist(dist)), rep=100):.3f}")
        print(f"{kind} {esize}B {dist}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
