"""Fused Triton kernels: generate z(seed, offset) in registers and apply it, never writing z to memory.

Same element layout and arithmetic as probe_kernels.reference (read its docstring). Fused multiply-add is
switched off (``enable_fp_fusion=False``) so results equal the reference bit for bit. Each program owns
NC whole Philox calls (NC * EPC elements, EPC = 16 for gauss8, 128 for rademacher), aligned in the
global element order, and masks elements outside its tensor, so any global offset is supported.

Import this module only where triton is importable; on CPU it runs under ``TRITON_INTERPRET=1`` (set
before triton is first imported).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from probe_kernels.dist import GAUSS8_TABLE, ProbeDist, as_dist
from probe_kernels.philox import check_seed
from probe_kernels.reference import check_range

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (elements per program, warps) by (kernel, element size in bytes, distribution): the fastest options found
# on an H200 over gpt2-small's and gpt2-large's parameter sizes (probe_kernels/NOTES.md); other keys fall back to
# (kernel, element size, None), then to (4096, 8).
TUNING: dict[tuple[str, int, str | None], tuple[int, int]] = {
    ("perturb", 2, None): (1024, 1), ("perturb", 4, None): (4096, 8),
    ("replay", 4, "gauss8"): (2048, 2), ("replay", 4, "rademacher"): (1024, 1),
}
_tables: dict[torch.device, torch.Tensor] = {}


def interpreted() -> bool:
    """True when Triton runs in interpreter mode (TRITON_INTERPRET=1): kernels then take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _codes(seed, cbase, NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr):
    """(NC, EPC) uint32 codes of global elements (cbase + r) * EPC + e: bytes (gauss8) or bits (rademacher).

    join/reshape keep a counter's four words in one thread, so each Philox call is computed once and every
    bit of it is used (16 bytes or 128 bits); selecting words with tl.where instead spread a call over
    several threads, each recomputing it (4x slower replay, probe_kernels/NOTES.md)."""
    c = cbase + tl.arange(0, NC).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, c)
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (NC, 4))  # [c, w] = r_w
    if GAUSS:
        sh = (tl.arange(0, 4) * 8).to(tl.uint32)
        return tl.reshape((words[:, :, None] >> sh[None, None, :]) & 0xFF, (NC, EPC))  # [c, 4w + b]
    else:
        sh = tl.arange(0, 32).to(tl.uint32)
        return tl.reshape((words[:, :, None] >> sh[None, None, :]) & 1, (NC, EPC))  # [c, 32w + j]


@triton.jit
def _z_tile(seed, cbase, table_ptr, NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr):
    """(NC, EPC) fp32 tile: z of global elements (cbase + r) * EPC + e, r < NC, e < EPC."""
    code = _codes(seed, cbase, NC, EPC, GAUSS)
    if GAUSS:
        return tl.load(table_ptr + code.to(tl.int32))
    else:
        return 1.0 - 2.0 * code.to(tl.float32)


@triton.jit
def _add_cz(acc, c, seed, cbase, table_ptr, NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr):
    """acc + fl(c * z) for one seed; for signs fl(c * +-1) = +-c exactly, so a select replaces the multiply."""
    if GAUSS:
        return acc + c * _z_tile(seed, cbase, table_ptr, NC, EPC, GAUSS)
    else:
        return acc + tl.where(_codes(seed, cbase, NC, EPC, GAUSS) != 0, -c, c)


@triton.jit
def _round_out(x, out_ptr, HWCVT: tl.constexpr):
    """Round fp32 `x` to out_ptr's element type, to nearest even. Compiled code uses the hardware conversion
    (HWCVT; cvt.rn, 1 instruction). The interpreter truncates fp32 -> bf16, so there bf16 is rounded with
    integer ops; both equal torch's rounding for every non-NaN value (NaN stays a NaN, payload may differ)."""
    if HWCVT:
        return x.to(out_ptr.dtype.element_ty)
    elif out_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)  # NaN stays a quiet NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _local_index(pid, head, NC: tl.constexpr, EPC: tl.constexpr):
    return pid * (NC * EPC) + tl.arange(0, NC)[:, None] * EPC + tl.arange(0, EPC)[None, :] - head


@triton.jit
def _perturb_kernel(w_ptr, out_ptr, n, head, cbase0, seed, alpha, table_ptr,
                    NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr, HWCVT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = _local_index(pid, head, NC, EPC)
    m = (idx >= 0) & (idx < n)
    w = tl.load(w_ptr + idx, mask=m).to(tl.float32)
    z = _z_tile(seed, cbase0 + pid * NC, table_ptr, NC, EPC, GAUSS)
    tl.store(out_ptr + idx, _round_out(w + alpha * z, out_ptr, HWCVT), mask=m)


@triton.jit
def _replay_kernel(w_ptr, n, head, cbase0, seeds_ptr, coeffs_ptr, K, table_ptr,
                   NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr, HWCVT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = _local_index(pid, head, NC, EPC)
    m = (idx >= 0) & (idx < n)
    acc = tl.load(w_ptr + idx, mask=m).to(tl.float32)
    cbase = cbase0 + pid * NC
    for k in range(K):
        s = tl.load(seeds_ptr + k)
        c = tl.load(coeffs_ptr + k)
        acc = _add_cz(acc, c, s, cbase, table_ptr, NC, EPC, GAUSS)
    tl.store(w_ptr + idx, _round_out(acc, w_ptr, HWCVT), mask=m)


@triton.jit
def _list_entry(blk_ptr, meta_ptr, ALIGNED: tl.constexpr):
    """Per-program lookup in the packed table: (delta_in, delta_out, n, head, cbase, block index)."""
    pid = tl.program_id(0)
    t = tl.load(blk_ptr + 2 * pid).to(tl.int64)
    b = tl.load(blk_ptr + 2 * pid + 1).to(tl.int64)
    row = meta_ptr + 5 * t
    d_in = tl.load(row)
    d_out = tl.load(row + 1)
    n = tl.load(row + 2)
    head = tl.load(row + 3)
    cbase = tl.load(row + 4)
    if ALIGNED:  # host checked: 16-element aligned starts and sizes, each tensor starts a Philox call
        d_in = tl.multiple_of(d_in, 16)
        d_out = tl.multiple_of(d_out, 16)
        n = tl.multiple_of(n, 16)
        head = 0
    return d_in, d_out, n, head, cbase, b


@triton.jit
def _perturb_list_kernel(w_base, out_base, blk_ptr, meta_ptr, seed, alpha, table_ptr,
                         NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr, ALIGNED: tl.constexpr,
                         HWCVT: tl.constexpr):
    d_in, d_out, n, head, cbase, b = _list_entry(blk_ptr, meta_ptr, ALIGNED)
    idx = _local_index(b, head, NC, EPC)
    m = (idx >= 0) & (idx < n)
    w = tl.load(w_base + d_in + idx, mask=m).to(tl.float32)
    z = _z_tile(seed, cbase + b * NC, table_ptr, NC, EPC, GAUSS)
    tl.store(out_base + d_out + idx, _round_out(w + alpha * z, out_base, HWCVT), mask=m)


@triton.jit
def _replay_list_kernel(w_base, blk_ptr, meta_ptr, seeds_ptr, coeffs_ptr, K, table_ptr,
                        NC: tl.constexpr, EPC: tl.constexpr, GAUSS: tl.constexpr, ALIGNED: tl.constexpr,
                        HWCVT: tl.constexpr):
    d_in, _d_out, n, head, cbase, b = _list_entry(blk_ptr, meta_ptr, ALIGNED)
    idx = _local_index(b, head, NC, EPC)
    m = (idx >= 0) & (idx < n)
    acc = tl.load(w_base + d_in + idx, mask=m).to(tl.float32)
    cb = cbase + b * NC
    for k in range(K):
        s = tl.load(seeds_ptr + k)
        c = tl.load(coeffs_ptr + k)
        acc = _add_cz(acc, c, s, cb, table_ptr, NC, EPC, GAUSS)
    tl.store(w_base + d_in + idx, _round_out(acc, w_base, HWCVT), mask=m)


# ----------------------------------------------------------------------------- launchers


def _table(device: torch.device) -> torch.Tensor:
    if device not in _tables:
        _tables[device] = torch.from_numpy(GAUSS8_TABLE.copy()).to(device)
    return _tables[device]


def check_tensor(t: torch.Tensor, name: str, dtypes=FLOAT_DTYPES) -> None:
    """Raise TypeError/ValueError unless `t` is a contiguous tensor of an allowed dtype on a device the
    kernels can reach (CUDA; CPU only in interpreter mode)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; the kernel takes {[str(d) for d in dtypes]}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    want = "cpu" if interpreted() else "cuda"
    if t.device.type != want:
        raise ValueError(f"{name} is on {t.device}; the Triton kernels need a {want} tensor here "
                         "(use probe_kernels.perturb/axpy_/replay_, which fall back to the PyTorch reference)")


def _config(kind: str, t: torch.Tensor, dist: ProbeDist) -> tuple[int, int]:
    es = t.element_size()
    return TUNING.get((kind, es, dist.value), TUNING.get((kind, es, None), (4096, 8)))


def _geometry(offset: int, dist: ProbeDist, block: int) -> tuple[int, int, int, int]:
    epc = dist.elems_per_call
    return block // epc, epc, offset % epc, offset // epc


def _seed_arg(seed: int) -> int:
    # Triton types a Python int >= 2**63 as uint64 and smaller ones as int32/int64; both reach
    # tl.randint4x as the same 64-bit pattern.
    return check_seed(seed)


def perturb_triton(w: torch.Tensor, seed: int, offset: int, alpha: float, dist: ProbeDist | str,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """out = w + alpha * z(seed)[offset : offset + w.numel()] (fp32 math, one rounding); returns out.

    w, out: contiguous, same shape/dtype (float32, bfloat16, float16), same CUDA device; out may be w.
    Raises TypeError/ValueError for bad inputs.
    """
    dist = as_dist(dist)
    check_tensor(w, "w")
    check_range(offset, w.numel())
    if out is None:
        out = torch.empty_like(w)
    check_tensor(out, "out")
    if out.shape != w.shape or out.dtype != w.dtype or out.device != w.device:
        raise ValueError(f"out must match w: got {tuple(out.shape)} {out.dtype} {out.device} "
                         f"vs {tuple(w.shape)} {w.dtype} {w.device}")
    n = w.numel()
    if n == 0:
        return out
    block, warps = _config("perturb", w, dist)
    nc, epc, head, cbase = _geometry(offset, dist, block)
    grid = (triton.cdiv(n + head, nc * epc),)
    _perturb_kernel[grid](w, out, n, head, cbase, _seed_arg(seed), float(alpha), _table(w.device),
                          NC=nc, EPC=epc, GAUSS=dist is ProbeDist.GAUSS8, HWCVT=not interpreted(), num_warps=warps,
                          enable_fp_fusion=False)
    return out


def _check_seeds(seeds: torch.Tensor, coeffs: torch.Tensor, device: torch.device) -> None:
    if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.dim() != 1:
        raise TypeError("seeds must be a (K,) int64 tensor (seeds >= 2**63 stored as two's complement)")
    if not isinstance(coeffs, torch.Tensor) or coeffs.dtype != torch.float32 or coeffs.shape != seeds.shape:
        raise TypeError(f"coeffs must be a float32 tensor of shape {tuple(seeds.shape)}")
    if seeds.device != device or coeffs.device != device or not seeds.is_contiguous() or not coeffs.is_contiguous():
        raise ValueError(f"seeds and coeffs must be contiguous tensors on {device}")


def replay_triton(w: torch.Tensor, seeds: torch.Tensor, coeffs: torch.Tensor, offset: int,
                  dist: ProbeDist | str) -> torch.Tensor:
    """In place: w <- w + sum_k coeffs[k] * z(seeds[k])[offset : offset + w.numel()], fp32 accumulation in
    order k = 0..K-1; one pass over w. w: contiguous float32 (or bf16/fp16, rounded once at the end).
    seeds: (K,) int64, coeffs: (K,) float32, both on w's device. Returns w."""
    dist = as_dist(dist)
    check_tensor(w, "w")
    check_range(offset, w.numel())
    _check_seeds(seeds, coeffs, w.device)
    n = w.numel()
    if n == 0 or seeds.numel() == 0:
        return w
    block, warps = _config("replay", w, dist)
    nc, epc, head, cbase = _geometry(offset, dist, block)
    grid = (triton.cdiv(n + head, nc * epc),)
    _replay_kernel[grid](w, n, head, cbase, seeds, coeffs, seeds.numel(), _table(w.device),
                         NC=nc, EPC=epc, GAUSS=dist is ProbeDist.GAUSS8, HWCVT=not interpreted(), num_warps=warps,
                         enable_fp_fusion=False)
    return w


class PackedList:
    """Device-side table for one launch over many tensors (same dtype and device).

    blk: (P, 2) int32 rows (tensor index, block index within the tensor), one per program;
    meta: (T, 5) int64 rows (element delta of the input from the base tensor, same for the output,
    numel, head, first Philox counter). Built once per (tensor addresses, offsets, dist) and cached.
    """

    def __init__(self, ins: list[torch.Tensor], outs: list[torch.Tensor], offsets: list[int], dist: ProbeDist,
                 block: int):
        if not ins or len(ins) != len(outs) or len(ins) != len(offsets):
            raise ValueError(f"need equally long non-empty lists: {len(ins)} tensors, {len(outs)} outputs, "
                             f"{len(offsets)} offsets")
        base_in, base_out = ins[0], outs[0]
        esize = base_in.element_size()
        nc, epc = block // dist.elems_per_call, dist.elems_per_call
        rows, blk_t, blk_b = [], [], []
        aligned = True
        for i, (w, o, off) in enumerate(zip(ins, outs, offsets)):
            check_tensor(w, f"tensors[{i}]")
            check_tensor(o, f"outs[{i}]")
            check_range(off, w.numel())
            if w.dtype != base_in.dtype or w.device != base_in.device or o.shape != w.shape or o.dtype != w.dtype \
                    or o.device != w.device:
                raise ValueError(f"tensor {i}: all tensors and outputs must share one dtype and device "
                                 f"and outputs must match their inputs' shapes (group by dtype first)")
            d_in, d_out = w.data_ptr() - base_in.data_ptr(), o.data_ptr() - base_out.data_ptr()
            if d_in % esize or d_out % esize:
                raise ValueError(f"tensor {i} is not element-aligned relative to tensor 0")
            head = off % epc
            aligned &= head == 0 and w.numel() % 16 == 0 and d_in % (16 * esize) == 0 and d_out % (16 * esize) == 0
            rows.append([d_in // esize, d_out // esize, w.numel(), head, off // epc])
            nblk = triton.cdiv(w.numel() + head, nc * epc)
            blk_t.append(torch.full((nblk,), i, dtype=torch.int32))
            blk_b.append(torch.arange(nblk, dtype=torch.int32))
        dev = base_in.device
        self.aligned = aligned and base_in.data_ptr() % 16 == 0 and base_out.data_ptr() % 16 == 0
        self.blk = torch.stack([torch.cat(blk_t), torch.cat(blk_b)], dim=1).contiguous().to(dev)
        self.meta = torch.tensor(rows, dtype=torch.int64).to(dev)
        self.device = dev  # no tensor references kept: the cache must not pin memory
        self.nc, self.epc = nc, epc
        self.programs = int(self.blk.shape[0])


_packed_cache: dict[tuple, PackedList] = {}
_PACKED_CACHE_SIZE = 64  # tables are ~8 B per program; an evaluator needs one per unit


def _sig(ts: list[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t.numel(), t.dtype, t.device, t.is_contiguous()) for t in ts)


def _packed(ins, outs, offsets, dist, block) -> PackedList:
    key = (dist, block, _sig(ins), _sig(outs), tuple(offsets))
    hit = _packed_cache.pop(key, None)
    if hit is None:
        if len(_packed_cache) >= _PACKED_CACHE_SIZE:
            _packed_cache.pop(next(iter(_packed_cache)))  # least recently used
        hit = PackedList(ins, outs, offsets, dist, block)
    _packed_cache[key] = hit
    return hit


def list_plan(kind: str, tensors: list[torch.Tensor], outs: list[torch.Tensor], offsets: list[int],
              dist: ProbeDist | str) -> tuple[PackedList, int]:
    """(launch table, warps) for one launch of `kind` ("perturb" or "replay") over `tensors`; validates the
    lists (same dtype and device, matching outputs) and raises ValueError/TypeError otherwise."""
    dist = as_dist(dist)
    if not tensors:
        raise ValueError("need a non-empty tensor list")
    block, warps = _config(kind, tensors[0], dist)
    return _packed(tensors, outs, offsets, dist, block), warps


def launch_perturb_list(p: PackedList, warps: int, w0: torch.Tensor, out0: torch.Tensor, seed: int, alpha: float,
                        dist: ProbeDist) -> None:
    """The perturb launch over a prepared table: w0/out0 are the first input/output tensors it was built on."""
    _perturb_list_kernel[(p.programs,)](w0, out0, p.blk, p.meta, _seed_arg(seed), float(alpha),
                                        _table(p.device), NC=p.nc, EPC=p.epc,
                                        GAUSS=dist is ProbeDist.GAUSS8, ALIGNED=p.aligned, HWCVT=not interpreted(),
                                        num_warps=warps, enable_fp_fusion=False)


def launch_replay_list(p: PackedList, warps: int, w0: torch.Tensor, seeds: torch.Tensor, coeffs: torch.Tensor,
                       dist: ProbeDist) -> None:
    """The in-place replay launch over a prepared table (seeds (K,) int64, coeffs (K,) float32, checked)."""
    _check_seeds(seeds, coeffs, p.device)
    if seeds.numel() == 0:
        return
    _replay_list_kernel[(p.programs,)](w0, p.blk, p.meta, seeds, coeffs, seeds.numel(),
                                       _table(p.device), NC=p.nc, EPC=p.epc,
                                       GAUSS=dist is ProbeDist.GAUSS8, ALIGNED=p.aligned, HWCVT=not interpreted(),
                                       num_warps=warps, enable_fp_fusion=False)


def perturb_list_triton(tensors: list[torch.Tensor], offsets: list[int], seed: int, alpha: float,
                        dist: ProbeDist | str, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One launch: outs[i] = tensors[i] + alpha * z(seed)[offsets[i] : offsets[i] + numel] for every i.

    All tensors share one dtype and device; outs[i] matches tensors[i] (may be the same tensor).
    The device table is cached by tensor addresses, so reuse the same output buffers across calls.
    """
    dist = as_dist(dist)
    p, warps = list_plan("perturb", tensors, outs, offsets, dist)
    launch_perturb_list(p, warps, tensors[0], outs[0], seed, alpha, dist)
    return outs


def replay_list_triton(tensors: list[torch.Tensor], offsets: list[int], seeds: torch.Tensor,
                       coeffs: torch.Tensor, dist: ProbeDist | str) -> list[torch.Tensor]:
    """One launch, in place: tensors[i] += sum_k coeffs[k] * z(seeds[k]) over each tensor's global range."""
    dist = as_dist(dist)
    p, warps = list_plan("replay", tensors, tensors, offsets, dist)
    launch_replay_list(p, warps, tensors[0], seeds, coeffs, dist)
    return tensors
