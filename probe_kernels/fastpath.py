"""Whole-model probe evaluation: one scratch copy of the model, perturbed in one launch, forward compiled.

`WholeModelEvaluator` keeps a second copy of the model (the *shadow*) whose parameters are the scratch. A
probe is one `ModelPlan.perturb` launch (clean weights -> shadow, theta + alpha z(seed)) and one forward of
the shadow. On CUDA that forward is `torch.compile`d (static shapes, Inductor's deterministic mode) and,
optionally, replayed as CUDA graphs (mode "reduce-overhead"); the shadow's parameters never move, so the
compiled code and the graphs see each new perturbation in place. The clean loss L0 runs through the same
compiled forward on a copy of the clean weights, so L+ + L- - 2 L0 compares like with like.

Memory: one more copy of the parameters (and buffers). `make_evaluator` picks this path when that copy
fits in free memory with room left for activations, else the per-unit `ProbeEvaluator` (one unit of
scratch at a time), and logs the choice. Without compilation (CPU, or compile=False) the shadow runs the
very same eager module code on bit-identical perturbed weights, so its losses equal ProbeEvaluator's bit
for bit; compiled, they differ in the last bits (fused kernels, another reduction order), measured in
probe_kernels/NOTES.md.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from probe_kernels.dist import ProbeDist, as_dist
from probe_kernels.evaluator import ProbeEvaluator, canonical_offsets, checked_rows
from probe_kernels.ops import ModelPlan
from probe_kernels.philox import check_seed

log = logging.getLogger("sparecycles.kernels")

MODES = ("auto", "whole", "per_unit")


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (tied ones once) and buffers: what one more copy of it allocates."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def free_bytes(device: torch.device | str) -> int:
    """Free memory (bytes) of `device`: the CUDA driver's free count, or the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_mode(copy_bytes: int, free: int, reserve: int | None = None) -> str:
    """"whole" when one more copy of the model (`copy_bytes`) fits in `free` bytes with `reserve` bytes left
    for activations (default: max(2 GiB, a quarter of `free`)), else "per_unit". Raises ValueError for
    negative sizes."""
    if copy_bytes < 0 or free < 0 or (reserve is not None and reserve < 0):
        raise ValueError("sizes must be >= 0 bytes")
    if reserve is None:
        reserve = max(2 << 30, free // 4)
    return "whole" if copy_bytes + reserve <= free else "per_unit"


def _configure_inductor() -> bool:
    """Inductor's deterministic mode (no on-device benchmarking that changes numerics, so two processes
    compile the same kernels); returns whether this torch has it."""
    try:
        import torch._inductor.config as icfg
    except ImportError:
        return False
    import torch._dynamo.config as dcfg

    for name in ("cache_size_limit", "recompile_limit"):  # a worker compiles one code object per copy and shape
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(64, getattr(dcfg, name)))
    if hasattr(icfg, "deterministic"):
        icfg.deterministic = True
        return True
    return False


def _masks_outside_graph(model: torch.nn.Module) -> int:
    """Run transformers' attention-mask builders of `model`'s modeling module eagerly (graph breaks there).

    Traced by torch.compile, transformers (5.x with torch < 2.14) never skips the causal mask, so sdpa gets
    a materialised (B, 1, T, T) mask and leaves the flash kernel; run eagerly, the builder returns None for
    an unpadded causal batch and sdpa takes is_causal=True, as in the eager reference. Same function, same
    result; returns how many builders were wrapped (idempotent, process-wide for that module)."""
    import sys

    mod = sys.modules.get(type(model).__module__)
    n = 0
    for name in dir(mod) if mod is not None else ():
        fn = getattr(mod, name)
        if (name.startswith("create_") and name.endswith("_mask") and callable(fn)
                and getattr(fn, "__module__", "").startswith("transformers.") and not getattr(fn, "_eager_mask", False)):
            wrapped = torch.compiler.disable(fn)
            wrapped._eager_mask = True
            setattr(mod, name, wrapped)
            n += 1
    return n


def _sdpa_in_dtype(fn):
    """transformers' sdpa attention function, wrapped: a module carrying `_sc_attn_dtype` (set on a FastForward's
    copy only) gets query, key and value cast to that dtype (bf16: the flash kernel) and its output cast back;
    every other module calls `fn` unchanged."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        dtype = getattr(module, "_sc_attn_dtype", None)
        if dtype is None or query.dtype == dtype:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(dtype)
        out, weights = fn(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask, *args, **kwargs)
        return out.to(query.dtype), weights

    attention._sc_wrapped = True
    return attention


def _attention_in(shadow: torch.nn.Module, dtype: torch.dtype) -> int:
    """Run the copy's sdpa attention in `dtype` (activations only: no weight is cast); returns how many attention
    modules it marked. Installs `_sdpa_in_dtype` over transformers' "sdpa" entry once per process (a no-op for
    every unmarked module). 0 (nothing changed) when transformers has no attention registry."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return 0
    fn = ALL_ATTENTION_FUNCTIONS.get("sdpa") if hasattr(ALL_ATTENTION_FUNCTIONS, "get") else None
    if fn is None:
        return 0
    if not getattr(fn, "_sc_wrapped", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _sdpa_in_dtype(fn)
    n = 0
    for m in shadow.modules():
        if type(m).__name__.endswith("Attention"):
            m._sc_attn_dtype = dtype
            n += 1
    return n


class _PaddedHead(torch.nn.Module):
    """An output projection whose weight is the first `out_features` rows of a zero-padded (rows a multiple of
    64) buffer: the matmul writes 16-byte aligned rows (GPT-2's 50,257 columns are not), the logits are the
    first `out_features` columns. Holds the very same weight Parameter, so parameter names and order stay."""

    def __init__(self, weight: torch.nn.Parameter, padded: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.register_buffer("padded_weight", padded, persistent=False)
        self.out_features = weight.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.padded_weight)[..., : self.out_features]


def _pad_output_head(shadow: torch.nn.Module, multiple: int = 64) -> bool:
    """Swap the copy's bias-free Linear output embedding for a `_PaddedHead` (its weight, tied or not, becomes
    a view of the padded buffer); True if it did. Same logits up to the matmul's summation order."""
    get = getattr(shadow, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head.out_features % multiple == 0:
        return False
    w = head.weight
    rows = -(-w.shape[0] // multiple) * multiple
    padded = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
    padded[: w.shape[0]].copy_(w.data)
    w.data = padded[: w.shape[0]]  # the embedding (if tied) and the perturb kernel write these rows in place
    shadow.set_output_embeddings(_PaddedHead(w, padded))
    return True


class FastForward:
    """fn(copy, batch) on a private copy of a model (cast to `dtype`), compiled on CUDA: the fast path's forward.

    One code path for every fast forward of the project: the probe evaluator (`WholeModelEvaluator`: its copy
    is the perturbation scratch), the worker's evaluation rounds and teacher targets (bf16, nothing perturbed).
    The copy is made once per architecture; `load(model)` copies another model's weights of the same
    architecture into it (cast to the copy's dtype), keeping the compiled code and any CUDA graphs.

    Args:
        model: the module to copy (left untouched). fn(copy, batch) -> tensor or tuple of tensors (e.g.
            trainer.models.losses.lm_batch_loss -> 0-dim loss; `lm_logits` -> (B, T, V) logits in `dtype`).
        dtype: the copy's floating dtype (torch.bfloat16 for the bf16 fast path; None keeps the model's).
        compile: torch.compile fn (default: on CUDA; static shapes, Inductor's deterministic mode). A model the
            compiler cannot handle is run eagerly (logged) at the first call.
        cuda_graphs: compile in mode "reduce-overhead" (CUDA graphs: for static shapes; outputs cloned).
        pad_head / eager_masks: the compiled copy's GPT-2 fixes (`_pad_output_head`, `_masks_outside_graph`;
            default: when compiled). attn_dtype: run the copy's sdpa attention in this dtype (activations only, the
            weights keep `dtype`; e.g. bf16 attention on fp32 weights: the flash kernel; `_attention_in`). Uncompiled, the copy runs the model's exact code: with dtype None the
            outputs equal fn(model, batch) bit for bit.
    Raises TypeError for a model without parameters.
    """

    def __init__(self, model: torch.nn.Module, fn: Callable[[torch.nn.Module, object], object],
                 dtype: torch.dtype | None = None, compile: bool | None = None, cuda_graphs: bool = False,
                 pad_head: bool | None = None, eager_masks: bool | None = None, attn_dtype: torch.dtype | None = None):
        params = list(model.parameters())
        if not params:
            raise TypeError(f"{type(model).__name__} has no parameters")
        self.model, self.fn = model, fn
        device = params[0].device
        self.compiled = bool(device.type == "cuda" if compile is None else compile)
        self.dtype = dtype
        with torch.no_grad():
            self.shadow = copy.deepcopy(model).eval()
            if dtype is not None:
                self.shadow.to(dtype)
            for p in self.shadow.parameters():
                if not p.data.is_contiguous():
                    p.data = p.data.contiguous()
            # compiled only: uncompiled, the copy runs the reference's exact code (bit-identical losses)
            self.padded_head = _pad_output_head(self.shadow) if (self.compiled if pad_head is None else pad_head) else False
        self.eager_masks = _masks_outside_graph(model) if (self.compiled if eager_masks is None else eager_masks) else 0
        self.attn_dtype = attn_dtype if attn_dtype is not None and _attention_in(self.shadow, attn_dtype) else None
        self.cuda_graphs = bool(cuda_graphs and self.compiled and device.type == "cuda")
        self.inductor_deterministic = _configure_inductor() if self.compiled else False
        shadow = self.shadow

        def forward(batch):
            return fn(shadow, batch)

        self._eager = forward
        self._forward = forward
        if self.compiled:
            self._forward = torch.compile(forward, dynamic=False,
                                          mode="reduce-overhead" if self.cuda_graphs else None)
        self.compile_seconds: float | None = None
        self.device = device

    def same_architecture(self, model: torch.nn.Module) -> bool:
        """True if `model` has the copy's class and its parameter names and shapes (any dtype, same device)."""
        if type(model) is not type(self.model) or self.shadow is None:
            return False
        rows, old = canonical_offsets(model), canonical_offsets(self.model)
        return len(rows) == len(old) and all(
            n == m and o == k and p.shape == q.shape and p.device == q.device
            for (n, p, o), (m, q, k) in zip(rows, old))

    @torch.no_grad()
    def load(self, model: torch.nn.Module) -> bool:
        """Copy `model`'s parameters and buffers into the copy (cast to its dtype), keeping the compiled forward:
        True if `model` has the same architecture (`same_architecture`), else False and nothing changes."""
        if not self.same_architecture(model):
            return False
        bufs, sbufs = dict(model.named_buffers()), dict(self.shadow.named_buffers())
        if any(k not in sbufs or bufs[k].shape != sbufs[k].shape for k in bufs):
            return False
        src = [p.detach() for _, p, _ in canonical_offsets(model)]
        dst = [p.detach() for _, p, _ in canonical_offsets(self.shadow)]
        for d, s in zip(dst, src):
            d.copy_(s)
        for k, b in bufs.items():
            sbufs[k].copy_(b)
        self.model = model
        return True

    def launch(self, batch):
        """fn(copy, batch), not waited for (detached; cloned under CUDA graphs, whose outputs the next replay
        overwrites). The first call compiles and is timed (`compile_seconds`)."""
        if self.compile_seconds is None and self.compiled:
            t0 = time.perf_counter()
            try:
                out = self._run(batch)
            except Exception:  # a model the compiler cannot handle is still evaluated (eagerly)
                log.exception("torch.compile failed for %s; evaluating eagerly", type(self.model).__name__)
                self._forward, self.compiled, self.cuda_graphs = self._eager, False, False
                out = self._run(batch)
            if self.compiled and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.compile_seconds = time.perf_counter() - t0
            return out
        return self._run(batch)

    def _run(self, batch):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
            return _detach(self._forward(batch), clone=True)
        return _detach(self._forward(batch), clone=False)

    @torch.no_grad()
    def __call__(self, batch):
        """fn(copy, batch) (see `launch`), under torch.no_grad."""
        return self.launch(batch)

    def close(self) -> None:
        """Free the copy and the compiled forward."""
        self._forward, self._eager, self.shadow = None, None, None


def _detach(out, clone: bool):
    if isinstance(out, torch.Tensor):
        return out.detach().clone() if clone else out.detach()
    return type(out)(_detach(o, clone) for o in out)


def lm_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits: x int64 (B, T) -> (B, T, V) in the model's dtype (FastForward's `fn` for teacher
    targets: `FastForward(model, lm_logits, dtype=torch.bfloat16)(x)`)."""
    return model(input_ids=x).logits


class WholeModelEvaluator:
    """L(theta + alpha z(seed); batch) through one perturbed scratch copy of the whole model.

    model: any torch.nn.Module (left untouched: the clean weights are only read); loss_fn(model, batch) ->
    scalar tensor. The copy and its forward are a `FastForward` (compile: torch.compile it, default on CUDA;
    cuda_graphs: mode "reduce-overhead", default off). Same methods as ProbeEvaluator (loss, clean_loss,
    losses, loss_swapped, close). Raises TypeError/ValueError for a bad model or loss_fn.
    """

    mode = "whole"

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
                 compile: bool | None = None, cuda_graphs: bool = False, pad_head: bool | None = None,
                 eager_masks: bool | None = None, attn_dtype: torch.dtype | None = None):
        rows = checked_rows(model, loss_fn)
        self.model, self.loss_fn = model, loss_fn
        self.fwd = FastForward(model, loss_fn, compile=compile, cuda_graphs=cuda_graphs, pad_head=pad_head,
                               eager_masks=eager_masks, attn_dtype=attn_dtype)
        self.shadow = self.fwd.shadow
        shadow_rows = canonical_offsets(self.shadow)
        if [(n, o) for n, _, o in rows] != [(n, o) for n, _, o in shadow_rows]:
            raise ValueError("the model's copy has another parameter order (a module with custom __deepcopy__?)")
        self.clean = [p.detach() if p.is_contiguous() else p.detach().contiguous() for _, p, _ in rows]
        self.scratch = [p.detach() for _, p, _ in shadow_rows]
        self.offsets = [o for _, _, o in rows]
        self.numel = sum(t.numel() for t in self.clean)
        self._plans: dict[ProbeDist, ModelPlan] = {}
        self._state: object = None  # what the scratch holds: "clean", (seed, alpha, dist), or None (unknown)

    compiled = property(lambda self: self.fwd.compiled)
    cuda_graphs = property(lambda self: self.fwd.cuda_graphs)
    compile_seconds = property(lambda self: self.fwd.compile_seconds)
    padded_head = property(lambda self: self.fwd.padded_head)
    eager_masks = property(lambda self: self.fwd.eager_masks)
    inductor_deterministic = property(lambda self: self.fwd.inductor_deterministic)

    def rebind(self, model: torch.nn.Module) -> bool:
        """Evaluate `model` (e.g. the next weight version) through this copy, keeping its compiled forward and
        CUDA graphs: True if `model` has the same class, parameter names, shapes, dtypes and device (its
        buffers are copied in), else False and nothing changes."""
        if self.shadow is None or not self.fwd.same_architecture(model):
            return False
        rows = canonical_offsets(model)
        if any(p.dtype != q.dtype for (_, p, _), q in zip(rows, self.clean)):
            return False
        bufs, sbufs = dict(model.named_buffers()), dict(self.shadow.named_buffers())
        if any(k not in sbufs or bufs[k].shape != sbufs[k].shape for k in bufs):
            return False
        with torch.no_grad():
            for k, b in bufs.items():
                sbufs[k].copy_(b)
        self.model = self.fwd.model = model
        self.clean = [p.detach() if p.is_contiguous() else p.detach().contiguous() for _, p, _ in rows]
        self._plans.clear()
        self._state = None
        return True

    def _plan(self, dist: ProbeDist) -> ModelPlan:
        plan = self._plans.get(dist)
        if plan is None:
            plan = self._plans[dist] = ModelPlan(self.clean, self.offsets, dist, outs=self.scratch)
        return plan

    def _set_clean(self) -> None:
        if self._state != "clean":
            torch._foreach_copy_(self.scratch, self.clean)
            self._state = "clean"

    @torch.no_grad()
    def forward_loss(self, batch) -> float:
        """The loss of whatever the scratch holds now (the timed forward of `sparecycles bench probe`)."""
        return float(self.fwd.launch(batch))

    def _launch(self, batch) -> torch.Tensor:
        """The loss as a 0-dim tensor, not waited for (a CUDA-graph output is cloned before the next replay)."""
        return self.fwd.launch(batch)

    @torch.no_grad()
    def loss(self, batch, seed: int | None = None, alpha: float = 0.0,
             dist: ProbeDist | str = ProbeDist.GAUSS8) -> float:
        """L(theta + alpha * z(seed); batch) as a float; seed None or alpha 0 gives the clean loss L0.

        Raises TypeError/ValueError for a bad seed or distribution (before any forward)."""
        dist = as_dist(dist)
        if seed is None or alpha == 0.0:
            self._set_clean()
        else:
            self._state = None  # first: a perturbation cut short (a serving worker's chunk hook) leaves it unknown
            self._plan(dist).perturb(seed, float(alpha))
        return self.forward_loss(batch)

    def clean_loss(self, batch) -> float:
        """L0 = L(theta; batch), through the same forward as the probes."""
        return self.loss(batch)

    @torch.no_grad()
    def losses(self, batch, seeds: Sequence[int], alpha: float,
               dist: ProbeDist | str = ProbeDist.GAUSS8) -> list[tuple[float, float]]:
        """[(L(theta + alpha z_s), L(theta - alpha z_s)) for s in seeds] on one shared batch.

        Pipelined: every perturb launch and forward is queued and the losses are read once at the end, so the
        host's per-probe work hides behind the GPU's. The same kernels run in the same order as with `loss`, so
        the values are the same bits. Raises like `loss`, before anything is launched for a bad seed."""
        dist = as_dist(dist)
        seeds = list(seeds)
        if not seeds:
            return []
        if alpha == 0.0:
            l0 = self.loss(batch)
            return [(l0, l0) for _ in seeds]
        plan = self._plan(dist)
        for s in seeds:
            check_seed(s)
        out: list[float | torch.Tensor] = []
        first = self.compiled and self.compile_seconds is None
        for s in seeds:
            for a in (float(alpha), -float(alpha)):
                self._state = None  # before: a cut perturbation leaves the scratch unknown, not clean
                plan.perturb(s, a)
                if first:  # the first call compiles (and may fall back to eager): through forward_loss
                    out.append(self.forward_loss(batch))
                    first = False
                else:
                    out.append(self._launch(batch))
        queued = [t for t in out if isinstance(t, torch.Tensor)]
        read = iter(torch.stack([t.float() for t in queued]).tolist() if queued else [])  # the one wait
        vals = [v if isinstance(v, float) else next(read) for v in out]
        return [(vals[2 * i], vals[2 * i + 1]) for i in range(len(seeds))]

    @torch.no_grad()
    def loss_swapped(self, batch, new: dict[int, torch.Tensor] | None) -> float:
        """The loss with canonical block i replaced by new[i] (None or {}: the clean loss), same forward.

        new[i] must have block i's shape and dtype (ValueError otherwise)."""
        self._set_clean()
        for i, t in (new or {}).items():
            dst = self.scratch[i]
            if t.shape != dst.shape or t.dtype != dst.dtype:
                raise ValueError(f"block {i} is {dst.dtype}{tuple(dst.shape)}, got {t.dtype}{tuple(t.shape)}")
            self._state = None
            dst.copy_(t)
        return self.forward_loss(batch)

    def close(self) -> None:
        """Free the scratch copy and the compiled forward."""
        self._plans.clear()
        self.scratch = []
        self.fwd.close()
        self.shadow = None


def make_evaluator(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
                   mode: str = "auto", compile: bool | None = None, cuda_graphs: bool = False,
                   reserve: int | None = None, attn_dtype: torch.dtype | None = None):
    """The probe evaluator for `model`: WholeModelEvaluator ("whole") or ProbeEvaluator ("per_unit").

    mode "auto" chooses from free memory (`choose_mode`, `reserve` bytes kept for activations) and logs the
    choice with its numbers at INFO. compile/cuda_graphs/attn_dtype go to WholeModelEvaluator. Raises ValueError for an
    unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"probe path mode must be one of {MODES}, got {mode!r}")
    params = [p for _, p, _ in canonical_offsets(model)]
    device = params[0].device if params else torch.device("cpu")
    need = model_bytes(model)
    chosen = mode
    if mode == "auto":
        free = free_bytes(device)
        chosen = choose_mode(need, free, reserve)
        log.info("probe path: %s (one more model copy needs %.2f GB; %.2f GB free on %s)",
                 chosen, need / 1e9, free / 1e9, device)
    else:
        log.info("probe path: %s (set explicitly; one model copy is %.2f GB)", chosen, need / 1e9)
    if chosen == "whole":
        return WholeModelEvaluator(model, loss_fn, compile=compile, cuda_graphs=cuda_graphs, attn_dtype=attn_dtype)
    return ProbeEvaluator(model, loss_fn)
