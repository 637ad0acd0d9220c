"""The fast path's forward: `FastForward`, fn(copy, batch) on a private copy of a model, compiled on CUDA.

One code path for every fast forward of the project: the whole-model probe evaluator (probe_kernels.fastpath's
`WholeModelEvaluator`, whose copy is the perturbation scratch), the worker's evaluation rounds and teacher targets
(bf16, nothing perturbed, `lm_logits`). Compiled with static shapes in Inductor's deterministic mode, optionally
replayed as CUDA graphs, with the GPT-2 fixes the compiled copy needs (an output head padded to a multiple of 64,
attention-mask builders run outside the graph, attention in another dtype).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch

from probe_kernels.evaluator import canonical_offsets

log = logging.getLogger("sparecycles.kernels")

SEGMENT_ATTR = "_sparecycles_segment"  # set on each block of a segmented copy: a forward pre-hook's stop point


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: the children of its longest nn.ModuleList (GPT-2's `h`, Llama's
    `layers`); [] for a model without one."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    return list(max(lists, key=len)) if lists else []


def is_segment(module: torch.nn.Module) -> bool:
    """Whether `module` is a block of a segmented FastForward copy (a stop point between device work)."""
    return getattr(module, SEGMENT_ATTR, False)


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
        segmented: compile each repeated block on its own (`repeated_blocks`; the rest runs eagerly) and mark it
            (`is_segment`), so that a forward pre-hook runs between blocks, even compiled: where the worker waits
            for the device and checks whether to stop (probe_worker.preemption.Preemption), beside a serving engine.
            Without blocks the whole forward is compiled as usual; never with CUDA graphs.
        pad_head / eager_masks: the compiled copy's GPT-2 fixes (`_pad_output_head`, `_masks_outside_graph`;
            default: when compiled). attn_dtype: run the copy's sdpa attention in this dtype (activations only, the
            weights keep `dtype`; e.g. bf16 attention on fp32 weights: the flash kernel; `_attention_in`). Uncompiled, the copy runs the model's exact code: with dtype None the
            outputs equal fn(model, batch) bit for bit.
    Raises TypeError for a model without parameters.
    """

    def __init__(self, model: torch.nn.Module, fn: Callable[[torch.nn.Module, object], object],
                 dtype: torch.dtype | None = None, compile: bool | None = None, cuda_graphs: bool = False,
                 pad_head: bool | None = None, eager_masks: bool | None = None, attn_dtype: torch.dtype | None = None,
                 segmented: bool = False):
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
        # segmented: no CUDA graphs (one graph per block would hand each block's output to the next replay's pool)
        self.cuda_graphs = bool(cuda_graphs and self.compiled and device.type == "cuda" and not segmented)
        self.inductor_deterministic = _configure_inductor() if self.compiled else False
        shadow = self.shadow

        def forward(batch):
            return fn(shadow, batch)

        self._eager = forward
        self._forward = forward
        mode = "reduce-overhead" if self.cuda_graphs else None
        self.segments = _segment(self.shadow, self.compiled, mode) if segmented else 0
        if self.compiled and not self.segments:
            self._forward = torch.compile(forward, dynamic=False, mode=mode)
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
                for block in repeated_blocks(self.shadow) if self.segments else ():
                    block.__dict__.pop("forward", None)  # the class's own forward again
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


def _segment(shadow: torch.nn.Module, compiled: bool, mode: str | None) -> int:
    """Mark (and with `compiled`, compile on its own) each repeated block of `shadow`; returns how many."""
    blocks = repeated_blocks(shadow)
    for block in blocks:
        setattr(block, SEGMENT_ATTR, True)
        if compiled:  # the block's forward only: its module call, and so the pre-hooks, stay eager
            block.forward = torch.compile(block.forward, dynamic=False, mode=mode)
    return len(blocks)


def _detach(out, clone: bool):
    if isinstance(out, torch.Tensor):
        return out.detach().clone() if clone else out.detach()
    return type(out)(_detach(o, clone) for o in out)


def lm_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits: x int64 (B, T) -> (B, T, V) in the model's dtype (FastForward's `fn` for teacher
    targets: `FastForward(model, lm_logits, dtype=torch.bfloat16)(x)`)."""
    return model(input_ids=x).logits
