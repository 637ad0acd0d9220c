"""Bit-for-bit parity of the Triton kernels against the PyTorch reference.

Run as ``TRITON_INTERPRET=1 python -m probe_kernels.parity`` on CPU (the env var must be set before triton is
imported) or ``python -m probe_kernels.parity --device cuda`` on a GPU; exits 1 and lists failures on mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch

from probe_kernels.dist import ProbeDist
from probe_kernels.ops import ModelPlan, seeds_tensor
from probe_kernels.reference import direction_ref, perturb_ref, replay_ref

SEEDS = (0, 1, 12345, (1 << 32) + 7, (1 << 63) + 5, (1 << 64) - 1)
# (offset, numel): odd sizes, offsets inside a Philox call, across call and block boundaries
RANGES = ((0, 1), (5, 17), (16, 1000), (127, 3001), (1_000_003, 2049), ((1 << 34) + 9, 300))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, distinguishes -0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.cpu().contiguous().view(ints), b.cpu().contiguous().view(ints))


def _weights(n: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + tag)
    return (torch.randn(n, generator=g) * 0.05).to(dtype)


def run_parity(device: str = "cpu", scale: int = 1, dists: tuple[ProbeDist, ...] | None = None) -> list[str]:
    """Compare every Triton launcher with the reference; returns failure descriptions (empty = all equal).

    scale multiplies the sizes (use > 1 on a GPU to cover many programs per launch); dists: the
    distributions covered (default: all; the GPU tests take one each, so they can run in parallel).
    """
    from probe_kernels import triton_kernels as tk

    fails: list[str] = []
    dev = torch.device(device)
    case = 0
    for dist in (tuple(ProbeDist) if dists is None else tuple(ProbeDist(d) for d in dists)):
        for i, (off, n) in enumerate(RANGES):
            n *= scale
            seed = SEEDS[i % len(SEEDS)]
            for dtype in DTYPES:
                case += 1
                w = _weights(n, dtype, case)
                alpha = [1e-3, -0.37, 2.5][case % 3]
                got = tk.perturb_triton(w.to(dev), seed, off, alpha, dist)
                if not _same(got, perturb_ref(w, seed, off, alpha, dist)):
                    fails.append(f"perturb {dist.value} {dtype} seed={seed} offset={off} n={n}")
            z = tk.perturb_triton(torch.zeros(n, device=dev), seed, off, 1.0, dist)
            if not _same(z, direction_ref(seed, off, n, dist)):
                fails.append(f"direction {dist.value} seed={seed} offset={off} n={n}")
            w = _weights(n, torch.float32, case)
            got = w.to(dev, copy=True)
            tk.perturb_triton(got, seed, off, 0.01, dist, out=got)  # in place (axpy_)
            if not _same(got, perturb_ref(w, seed, off, 0.01, dist)):
                fails.append(f"axpy_ {dist.value} seed={seed} offset={off} n={n}")
            seeds, coeffs = list(SEEDS[:4]) + [seed], [0.5, -1.25, 3e-3, 7.0, -2e-4]
            for dtype in (torch.float32, torch.bfloat16):
                w = _weights(n, dtype, case + 7)
                got = tk.replay_triton(w.to(dev, copy=True), seeds_tensor(seeds, dev),
                                       torch.tensor(coeffs, device=dev), off, dist)
                if not _same(got, replay_ref(w, seeds, coeffs, off, dist)):
                    fails.append(f"replay {dist.value} {dtype} offset={off} n={n}")
        fails += _list_parity(dist, dev, scale)
    return fails


def _list_parity(dist: ProbeDist, dev: torch.device, scale: int) -> list[str]:
    from probe_kernels import triton_kernels as tk

    fails = []
    # unaligned (odd sizes back to back) and aligned (sizes multiple of 128, fresh allocations)
    for name, sizes in (("unaligned", [3, 700, 1, 129, 2500]), ("aligned", [128, 1024, 256, 4096 + 128])):
        sizes = [s * scale for s in sizes]
        offs, acc = [], 77 if name == "unaligned" else 0
        for s in sizes:
            offs.append(acc)
            acc += s
        for dtype in (torch.float32, torch.bfloat16):
            ws = [_weights(s, dtype, j) for j, s in enumerate(sizes)]
            if name == "unaligned":  # views into one buffer at odd element offsets
                flat = torch.cat(ws).to(dev)
                dws = list(torch.split(flat, sizes))
            else:
                dws = [w.to(dev, copy=True) for w in ws]
            seed = (1 << 40) + 3
            outs = [torch.empty_like(w) for w in dws]
            tk.perturb_list_triton(dws, offs, seed, -0.3, dist, outs)
            for j, (w, o) in enumerate(zip(ws, outs)):
                if not _same(o, perturb_ref(w, seed, offs[j], -0.3, dist)):
                    fails.append(f"perturb_list {name} {dist.value} {dtype} tensor {j}")
            seeds, coeffs = [1, (1 << 63) + 1, 99], [0.25, -1.5, 1e-3]
            plan = ModelPlan([w.to(dev, copy=True) for w in ws], offs, dist)  # prepared once, launched twice
            for call in range(2):
                for j, (w, o) in enumerate(zip(ws, plan.perturb(seed, -0.3))):
                    if not _same(o, perturb_ref(w, seed, offs[j], -0.3, dist)):
                        fails.append(f"ModelPlan.perturb call {call} {name} {dist.value} {dtype} tensor {j}")
            if dtype == torch.float32:
                plan.replay_(seeds, coeffs)
                for j, (w, o) in enumerate(zip(ws, plan.tensors)):
                    if not _same(o, replay_ref(w, seeds, coeffs, offs[j], dist)):
                        fails.append(f"ModelPlan.replay_ {name} {dist.value} tensor {j}")
            tk.replay_list_triton(dws, offs, seeds_tensor(seeds, dev), torch.tensor(coeffs, device=dev), dist)
            for j, (w, o) in enumerate(zip(ws, dws)):
                if not _same(o, replay_ref(w, seeds, coeffs, offs[j], dist)):
                    fails.append(f"replay_list {name} {dist.value} {dtype} tensor {j}")
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=int, default=1)
    args = ap.parse_args()
    fails = run_parity(args.device, args.scale)
    for f in fails:
        print("MISMATCH", f)
    print(f"parity on {args.device} (scale {args.scale}): {'OK' if not fails else f'{len(fails)} failures'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
