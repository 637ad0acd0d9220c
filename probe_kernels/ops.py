"""Public probe-kernel API: Triton on CUDA tensors, the bit-identical PyTorch reference everywhere else.

All functions take `offset`, the global position of a tensor's first element in the model's canonical flat
parameter order, so z is the same whatever the chunking, sharding, dtype or device (probe_kernels.reference).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache

import torch

from probe_kernels.dist import ProbeDist, as_dist
from probe_kernels.philox import SEED_LIMIT, check_seed
from probe_kernels.reference import check_range, direction_ref, perturb_ref, replay_ref, run_chunk_hooks

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `import triton` works (the Triton kernels are then used for CUDA tensors)."""
    try:
        import probe_kernels.triton_kernels  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: use the reference
        return False
    return True


def uses_triton(t: torch.Tensor) -> bool:
    """True when an op on `t` runs the Triton kernel (CUDA tensor, triton importable; or a CPU tensor under
    TRITON_INTERPRET=1, the interpreter the parity tests use), else the reference."""
    dev = t.device.type
    return (dev == "cuda" or (dev == "cpu" and _interpreting())) and triton_available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_float(t: torch.Tensor, name: str, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}"
                        + (" (apply updates to fp32 master weights)" if dtypes == (torch.float32,) else ""))


def seeds_tensor(seeds: Sequence[int] | torch.Tensor, device) -> torch.Tensor:
    """(K,) int64 tensor of 64-bit seeds on `device`; seeds >= 2**63 are stored as two's complement."""
    if isinstance(seeds, torch.Tensor):
        if seeds.dtype != torch.int64 or seeds.dim() != 1:
            raise TypeError("a seeds tensor must be (K,) int64")
        return seeds.to(device).contiguous()
    vals = [check_seed(s) for s in seeds]
    return torch.tensor([s - SEED_LIMIT if s >= 1 << 63 else s for s in vals], dtype=torch.int64, device=device)


def _seeds_list(seeds: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(seeds, torch.Tensor):
        if seeds.dtype != torch.int64 or seeds.dim() != 1:
            raise TypeError("a seeds tensor must be (K,) int64")
        return [int(s) % SEED_LIMIT for s in seeds.tolist()]
    return [check_seed(s) for s in seeds]


def _coeffs_tensor(coeffs: Sequence[float] | torch.Tensor, k: int, device) -> torch.Tensor:
    c = torch.as_tensor(coeffs, dtype=torch.float32).to(device).contiguous()
    if c.shape != (k,):
        raise ValueError(f"coeffs must have shape ({k},) to match the seeds, got {tuple(c.shape)}")
    return c


def direction(seed: int, offset: int, numel: int, dist: ProbeDist | str = ProbeDist.GAUSS8,
              device="cpu") -> torch.Tensor:
    """z(seed)[offset : offset + numel] as a (numel,) float32 tensor on `device` (materialised: for tests,
    digests and CPU workers; the apply ops never materialise z)."""
    device = torch.device(device)
    probe = torch.empty(0, device=device)
    if uses_triton(probe):
        check_range(offset, numel)
        return perturb(torch.zeros(numel, dtype=torch.float32, device=device), seed, offset, 1.0, dist)
    return direction_ref(seed, offset, numel, dist, device)


def perturb(w: torch.Tensor, seed: int, offset: int, alpha: float, dist: ProbeDist | str = ProbeDist.GAUSS8,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """out = w + alpha * z(seed)[offset : offset + w.numel()] in fp32, rounded once to w.dtype.

    w: any shape, float32/bfloat16/float16 (contiguous on CUDA). out: None (allocated) or a tensor of w's
    shape, dtype and device (may be w itself). Returns out. Raises TypeError/ValueError for bad inputs.
    """
    dist = as_dist(dist)
    _check_float(w, "w")
    if uses_triton(w):
        from probe_kernels.triton_kernels import perturb_triton

        return perturb_triton(w, seed, offset, alpha, dist, out)
    check_range(offset, w.numel())
    res = perturb_ref(w, seed, offset, alpha, dist)
    if out is None:
        return res
    if out.shape != w.shape or out.dtype != w.dtype or out.device != w.device:
        raise ValueError("out must have w's shape, dtype and device")
    return out.copy_(res)


def axpy_(w: torch.Tensor, seed: int, offset: int, alpha: float,
          dist: ProbeDist | str = ProbeDist.GAUSS8) -> torch.Tensor:
    """In place on fp32 master weights: w <- w + alpha * z(seed)[offset : offset + w.numel()]. Returns w.

    Raises TypeError unless w is float32 (tiny updates to bf16 weights round away; DESIGN.md section 1).
    """
    _check_float(w, "w", (torch.float32,))
    return perturb(w, seed, offset, alpha, dist, out=w)


def replay_(w: torch.Tensor, seeds: Sequence[int] | torch.Tensor, coeffs: Sequence[float] | torch.Tensor,
            offset: int, dist: ProbeDist | str = ProbeDist.GAUSS8) -> torch.Tensor:
    """In place on fp32 w: w <- w + sum_k coeffs[k] * z(seeds[k]) over w's global range, accumulated in
    fp32 in order k = 0..K-1 (bit-identical to K successive axpy_ calls). One pass over w on CUDA.

    seeds: K ints in [0, 2**64) or a (K,) int64 tensor; coeffs: K floats or a (K,) float32 tensor.
    """
    dist = as_dist(dist)
    _check_float(w, "w", (torch.float32,))
    if uses_triton(w):
        from probe_kernels.triton_kernels import replay_triton

        s = seeds_tensor(seeds, w.device)
        return replay_triton(w, s, _coeffs_tensor(coeffs, s.numel(), w.device), offset, dist)
    check_range(offset, w.numel())
    sl = _seeds_list(seeds)
    cl = _coeffs_tensor(coeffs, len(sl), "cpu").tolist()
    return w.copy_(replay_ref(w, sl, cl, offset, dist))


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def _check_lists(tensors, offsets) -> None:
    if len(tensors) != len(offsets):
        raise ValueError(f"{len(tensors)} tensors but {len(offsets)} offsets")


def perturb_model(tensors: Sequence[torch.Tensor], offsets: Sequence[int], seed: int, alpha: float,
                  dist: ProbeDist | str = ProbeDist.GAUSS8,
                  outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """outs[i] = tensors[i] + alpha * z(seed) over [offsets[i], offsets[i] + numel) for all i: one Triton
    launch per (dtype, device) group on CUDA. outs: None (allocated) or matching tensors (may alias the
    inputs for in-place). Reuse the same outs across calls: the launch table is cached by address."""
    dist = as_dist(dist)
    _check_lists(tensors, offsets)
    outs = [torch.empty_like(t) for t in tensors] if outs is None else list(outs)
    _check_lists(outs, offsets)
    for idx in _groups(tensors).values():
        if uses_triton(tensors[idx[0]]):
            from probe_kernels.triton_kernels import perturb_list_triton

            perturb_list_triton([tensors[i] for i in idx], [offsets[i] for i in idx], seed, alpha, dist,
                                [outs[i] for i in idx])
        else:
            _perturb_runs_ref([tensors[i] for i in idx], [offsets[i] for i in idx], seed, alpha, dist,
                              [outs[i] for i in idx])
    return outs


def _perturb_runs_ref(tensors, offsets, seed, alpha, dist, outs) -> None:
    """Reference perturb of many tensors, generating z once per run of back-to-back global ranges (same
    bits as per-tensor perturb_ref: z does not depend on chunking)."""
    order = sorted(range(len(tensors)), key=lambda i: offsets[i])
    a = torch.tensor(float(alpha), dtype=torch.float32)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and offsets[order[end]] == offsets[order[end - 1]] + tensors[order[end - 1]].numel():
            end += 1
        run = order[start:end]
        for i in run:
            check_range(offsets[i], tensors[i].numel())
            if outs[i].shape != tensors[i].shape or outs[i].dtype != tensors[i].dtype:
                raise ValueError(f"outs[{i}] must have the shape and dtype of tensors[{i}]")
        total = sum(tensors[i].numel() for i in run)
        z = direction_ref(seed, offsets[run[0]], total, dist, tensors[run[0]].device)
        pos = 0
        for i in run:
            w = tensors[i]
            zi = z[pos : pos + w.numel()].view(w.shape)
            pos += w.numel()
            outs[i].copy_((w.to(torch.float32) + a.to(w.device) * zi).to(w.dtype))
        start = end


def replay_model(tensors: Sequence[torch.Tensor], offsets: Sequence[int], seeds: Sequence[int] | torch.Tensor,
                 coeffs: Sequence[float] | torch.Tensor, dist: ProbeDist | str = ProbeDist.GAUSS8) -> list:
    """In place on fp32 tensors: replay_ over every tensor with its global offset (one launch on CUDA)."""
    dist = as_dist(dist)
    _check_lists(tensors, offsets)
    for t in tensors:
        _check_float(t, "tensors[i]", (torch.float32,))
    for (_, device), idx in _groups(tensors).items():
        if uses_triton(tensors[idx[0]]):
            from probe_kernels.triton_kernels import replay_list_triton

            s = seeds_tensor(seeds, device)
            replay_list_triton([tensors[i] for i in idx], [offsets[i] for i in idx], s,
                               _coeffs_tensor(coeffs, s.numel(), device), dist)
        else:
            for i in idx:
                replay_(tensors[i], seeds, coeffs, offsets[i], dist)
    return list(tensors)


class ModelPlan:
    """A model's parameter list prepared once for repeated whole-model perturb or replay launches.

    `perturb_model`/`replay_model` check and group their lists on every call: about 2 us of Python per
    tensor, 0.3 ms for gpt2-small's 148 tensors, which is more than the 0.13 ms its perturb kernel takes on
    an H200 (probe_kernels/NOTES.md). A plan does that work here, once; each call is then one kernel launch per
    (dtype, device) group on CUDA (the reference path elsewhere, same bits).

    tensors: contiguous parameter tensors (float32/bfloat16/float16; replay_ needs float32), offsets[i] (int
    >= 0) the global offset of tensors[i]; outs: perturb outputs matching tensors (None: allocated here; pass
    `tensors` for in place). `perturb` writes into `outs` and returns that same list on every call. The plan
    holds the tensors: rebuild it if any is reallocated (`param.data = ...`). Call it under torch.no_grad()
    when the tensors are Parameters. Raises ValueError/TypeError for bad lists.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                 dist: ProbeDist | str = ProbeDist.GAUSS8, outs: Sequence[torch.Tensor] | None = None):
        self.dist = as_dist(dist)
        self.tensors, self.offsets = list(tensors), list(offsets)
        _check_lists(self.tensors, self.offsets)
        for i, t in enumerate(self.tensors):
            _check_float(t, f"tensors[{i}]")
            check_range(self.offsets[i], t.numel())  # ints only: a float offset would silently shift z
            if not t.is_contiguous():
                raise ValueError(f"tensors[{i}] must be contiguous (call .contiguous() first)")
        self.outs = [torch.empty_like(t) for t in self.tensors] if outs is None else list(outs)
        if len(self.outs) != len(self.tensors):
            raise ValueError(f"{len(self.tensors)} tensors but {len(self.outs)} outs")
        for i, (t, o) in enumerate(zip(self.tensors, self.outs)):
            _check_float(o, f"outs[{i}]")
            if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device or not o.is_contiguous():
                raise ValueError(f"outs[{i}] must match tensors[{i}] in shape, dtype and device, and be contiguous")
        self._groups = list(_groups(self.tensors).values())
        self._triton: dict[tuple[str, int], tuple] = {}  # (kind, group) -> (table, warps, w0, out0)
        self._fp32_checked = False

    def _prepared(self, kind: str, g: int) -> tuple | None:
        idx = self._groups[g]
        if not uses_triton(self.tensors[idx[0]]):
            return None
        if (kind, g) not in self._triton:
            from probe_kernels.triton_kernels import list_plan

            ins = [self.tensors[i] for i in idx]
            outs = [self.outs[i] for i in idx] if kind == "perturb" else ins
            table, warps = list_plan(kind, ins, outs, [self.offsets[i] for i in idx], self.dist)
            self._triton[(kind, g)] = (table, warps, ins[0], outs[0])
        return self._triton[(kind, g)]

    def perturb(self, seed: int, alpha: float) -> list[torch.Tensor]:
        """outs[i] = tensors[i] + alpha * z(seed) over each tensor's global range; returns outs. Runs the chunk hooks
        first (probe_kernels.reference.add_chunk_hook)."""
        check_seed(seed)
        run_chunk_hooks()
        for g, idx in enumerate(self._groups):
            prep = self._prepared("perturb", g)
            if prep is None:
                _perturb_runs_ref([self.tensors[i] for i in idx], [self.offsets[i] for i in idx], seed, alpha,
                                  self.dist, [self.outs[i] for i in idx])
            else:
                from probe_kernels.triton_kernels import launch_perturb_list

                table, warps, w0, out0 = prep
                launch_perturb_list(table, warps, w0, out0, seed, alpha, self.dist)
        return self.outs

    def replay_(self, seeds: Sequence[int] | torch.Tensor, coeffs: Sequence[float] | torch.Tensor) -> list:
        """In place: tensors[i] += sum_k coeffs[k] * z(seeds[k]) (fp32 tensors only; replay_model's bits).

        seeds: K ints in [0, 2**64) or a (K,) int64 tensor; coeffs: K floats or a (K,) float32 tensor. Returns
        the tensors. Raises TypeError/ValueError for bad seeds or coeffs."""
        if not self._fp32_checked:
            for i, t in enumerate(self.tensors):
                _check_float(t, f"tensors[{i}]", (torch.float32,))
            self._fp32_checked = True
        for g, idx in enumerate(self._groups):
            prep = self._prepared("replay", g)
            if prep is None:
                for i in idx:
                    replay_(self.tensors[i], seeds, coeffs, self.offsets[i], self.dist)
            else:
                from probe_kernels.triton_kernels import launch_replay_list

                table, warps, w0, _ = prep
                s = seeds_tensor(seeds, w0.device)
                launch_replay_list(table, warps, w0, s, _coeffs_tensor(coeffs, s.numel(), w0.device), self.dist)
        return self.tensors
