"""Measure (elements per program, warps) options of the single-launch list kernels on this GPU.

``python -m probe_kernels.tune [--preset gpt2-small]`` prints, per kernel, the median time of each option over the
preset's parameter sizes; copy the best into triton_kernels.TUNING. Needs CUDA and triton.
"""

from __future__ import annotations

import argparse

import torch

from probe_kernels import triton_kernels as tk
from probe_kernels.bench import _ms, preset_sizes, preset_tensors
from probe_kernels.dist import ProbeDist
from probe_kernels.ops import ModelPlan

OPTIONS = [(1024, 1), (2048, 2), (4096, 4), (4096, 8), (8192, 8), (16384, 8)]


def tune(preset: str = "gpt2-small", k: int = 40, apply: bool = True) -> dict[tuple[str, int], tuple[int, int]]:
    """Time every option per kernel over `preset`'s sizes; returns the fastest (block, warps) per
    (kernel, element size, dist) key of triton_kernels.TUNING (perturb: gauss8 decides, stored for any dist)
    and, if `apply`, stores them there."""
    dev = torch.device("cuda")
    sizes = preset_sizes(preset)
    offs, w16, o16, w32 = preset_tensors(sizes, dev, torch.Generator(device=dev).manual_seed(0))
    seeds = torch.arange(1, k + 1, dtype=torch.int64, device=dev) * 7919
    coeffs = torch.full((k,), 1e-6, device=dev)
    def case(ws, outs, op):  # the plan is built outside the timing: it prepares its launch table once
        def build(d: ProbeDist):
            plan = ModelPlan(ws, offs, d, outs=outs)
            return (lambda: plan.perturb(3, 1e-3)) if op == "perturb" else (lambda: plan.replay_(seeds, coeffs))

        return build

    cases = {
        ("perturb", 2, "gauss8"): case(w16, o16, "perturb"),
        ("perturb", 4, "gauss8"): case(w32, w32, "perturb"),
        ("replay", 4, "gauss8"): case(w32, w32, "replay"),
        ("replay", 4, "rademacher"): case(w32, w32, "replay"),
    }
    print(f"{preset}: {sum(sizes) / 1e6:.1f}M params; median ms per option (block, warps)")
    best: dict[tuple[str, int, str | None], tuple[float, tuple[int, int]]] = {}
    saved = dict(tk.TUNING)
    for (kind, esize, dist), fn in cases.items():
        row = []
        for block, warps in OPTIONS:
            key = (kind, esize, dist if kind == "replay" else None)
            tk.TUNING[key] = (block, warps)
            tk._packed_cache.clear()
            call = fn(ProbeDist(dist))
            call()  # builds the table and compiles before timing
            ms = _ms(call, rep=60)
            row.append(f"{block}/{warps}: {ms:.3f}")
            if ms < best.get(key, (float("inf"),))[0]:
                best[key] = (ms, (block, warps))
        print(f"{kind} {esize}B {dist}: " + "  ".join(row), flush=True)
    choice = {key: cfg for key, (_, cfg) in best.items()}
    tk.TUNING.clear()
    tk.TUNING.update(saved)
    if apply:
        tk.TUNING.update(choice)
    tk._packed_cache.clear()
    print("best:", choice, flush=True)
    return choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--k", type=int, default=40)
    args = ap.parse_args()
    tune(args.preset, args.k, apply=False)


if __name__ == "__main__":
    main()
