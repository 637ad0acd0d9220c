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

import logging
import os
from collections.abc import Callable, Sequence

import torch

from probe_kernels.compiled_forward import FastForward, lm_logits  # noqa: F401  (public here too)
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


class WholeModelEvaluator:
    """L(theta + alpha z(seed); batch) through one perturbed scratch copy of the whole model.

    model: any torch.nn.Module (left untouched: the clean weights are only read); loss_fn(model, batch) ->
    scalar tensor. The copy and its forward are a `FastForward` (compile: torch.compile it, default on CUDA;
    cuda_graphs: mode "reduce-overhead", default off; segmented: compiled block by block, FastForward's). Same methods as ProbeEvaluator (loss, clean_loss,
    losses, loss_swapped, close). Raises TypeError/ValueError for a bad model or loss_fn.
    """

    mode = "whole"

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
                 compile: bool | None = None, cuda_graphs: bool = False, pad_head: bool | None = None,
                 eager_masks: bool | None = None, attn_dtype: torch.dtype | None = None, segmented: bool = False):
        rows = checked_rows(model, loss_fn)
        self.model, self.loss_fn = model, loss_fn
        self.fwd = FastForward(model, loss_fn, compile=compile, cuda_graphs=cuda_graphs, pad_head=pad_head,
                               eager_masks=eager_masks, attn_dtype=attn_dtype, segmented=segmented)
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
                   reserve: int | None = None, attn_dtype: torch.dtype | None = None, segmented: bool = False):
    """The probe evaluator for `model`: WholeModelEvaluator ("whole") or ProbeEvaluator ("per_unit").

    mode "auto" chooses from free memory (`choose_mode`, `reserve` bytes kept for activations) and logs the
    choice with its numbers at INFO. compile/cuda_graphs/attn_dtype/segmented go to WholeModelEvaluator. Raises ValueError for an
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
        return WholeModelEvaluator(model, loss_fn, compile=compile, cuda_graphs=cuda_graphs, attn_dtype=attn_dtype,
                                   segmented=segmented)
    return ProbeEvaluator(model, loss_fn)
