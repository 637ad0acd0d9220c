"""ProbeEvaluator: L(theta + alpha * z(seed); batch) without touching the clean weights.

The model's modules are grouped into *units*: the highest modules whose parameters (own and
descendants') total at most `budget` elements (default: the largest parameter's numel). Just before a
unit runs, a forward pre-hook writes all its parameters, perturbed, into a reused scratch arena in one
launch and swaps them in (``param.data = scratch``); its forward hook swaps the clean tensors back. So
scratch holds one unit at a time, plus one persistent copy per parameter shared by several units (tied
weights such as GPT-2's wte/lm_head), perturbed once per forward and kept until the forward ends. The
clean tensors are never written, so they stay bit-identical after any number of probes.

Limitation: a parameter read by code outside the forward of a unit that contains it is seen clean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from probe_kernels.dist import ProbeDist, as_dist
from probe_kernels.ops import ModelPlan

_ALIGN = 64  # elements: arena slices start 16-element aligned and at Philox-call boundaries


def canonical_offsets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    """(name, parameter, global offset) in canonical order = ``model.named_parameters()`` (tied weights once).

    The one computation of canonical offsets (elements): offset[k + 1] = offset[k] + numel of parameter k,
    offset[0] = 0. trainer.models.param_offsets and trainer.zo.probes.canonical_blocks read it from here.
    """
    out, acc = [], 0
    for n, p in model.named_parameters():
        out.append((n, p, acc))
        acc += p.numel()
    return out


def checked_rows(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor]) -> list:
    """`canonical_offsets(model)` after the checks every probe evaluator makes of its arguments.

    Raises TypeError for a non-Module model or a non-callable loss_fn, ValueError for a model without
    parameters.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
    rows = canonical_offsets(model)
    if not rows:
        raise ValueError("model has no parameters to perturb")
    return rows


def _unique_params(m: torch.nn.Module, recurse: bool) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in m.parameters(recurse=recurse):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def plan_units(model: torch.nn.Module, budget: int) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """Partition the parameter-owning modules into units (module, its parameters), top down: a module is a
    unit if its subtree holds at most `budget` elements or has no child with parameters; otherwise its
    own direct parameters form a unit and its children are visited. A container without a forward of its
    own (ModuleList, ModuleDict) is never a unit: its hooks would never run, so its parameters would be
    evaluated clean; its children are visited instead."""
    units = []

    def visit(m: torch.nn.Module) -> None:
        ps = _unique_params(m, recurse=True)
        if not ps:
            return
        kids = [c for c in m.children() if _unique_params(c, True)]
        container = type(m).forward is torch.nn.Module.forward
        if (sum(p.numel() for p in ps) <= budget and not (container and kids)) or not kids:
            units.append((m, ps))
            return
        own = _unique_params(m, recurse=False)
        if own:
            units.append((m, own))
        for c in kids:
            visit(c)

    visit(model)
    return units


class ProbeEvaluator:
    """Evaluates a model's loss at seeded perturbations theta + alpha * z(seed).

    model: any torch.nn.Module; loss_fn(model, batch) -> scalar tensor (e.g. mean token cross-entropy).
    budget: max elements per unit (default: the largest parameter's numel). Extra memory while probing is
    one unit's scratch plus the shared (tied) parameters' copies. Hooks are installed at construction and
    are inert outside `loss`; call `close()` to remove them.
    """

    mode = "per_unit"  # probe_kernels.fastpath.make_evaluator's name for this path

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
                 budget: int | None = None):
        rows = checked_rows(model, loss_fn)
        self.model, self.loss_fn = model, loss_fn
        self.offsets = {id(p): o for _, p, o in rows}
        self.numel = sum(p.numel() for _, p, _ in rows)
        self.budget = budget if budget is not None else max(p.numel() for _, p, _ in rows)
        self.units = plan_units(model, self.budget)
        count: dict[int, int] = {}
        for _, ps in self.units:
            for p in ps:
                count[id(p)] = count.get(id(p), 0) + 1
        self._shared = {pid for pid, k in count.items() if k > 1}
        self._probe: tuple[int, float, ProbeDist] | None = None
        self._live: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._arena: dict[tuple, torch.Tensor] = {}
        self._shared_scratch: dict[int, torch.Tensor] = {}
        self._scratch_version = 0  # bumped when any scratch buffer is reallocated: plans over it are stale
        # (unit, dist, ids of the params to perturb) -> (signature, ModelPlan): the launch table is prepared once
        # per unit; the signature (clean data pointers and dtypes, scratch version) catches reallocations
        self._plans: dict[tuple, tuple[tuple, ModelPlan]] = {}
        self._handles = []
        for u, (m, ps) in enumerate(self.units):
            self._handles.append(m.register_forward_pre_hook(self._make_pre(u, ps)))
            self._handles.append(m.register_forward_hook(self._make_post(ps)))

    def _scratch_for(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """Flat scratch views for `params`: shared ones get a persistent copy, the others arena slices."""
        outs, cursor = [], {}
        for p in params:
            t = p.data
            if id(p) in self._shared:
                s = self._shared_scratch.get(id(p))
                if s is None or s.dtype != t.dtype or s.device != t.device or s.shape != t.shape:
                    s = self._shared_scratch[id(p)] = torch.empty_like(t, memory_format=torch.contiguous_format)
                    self._scratch_version += 1
                outs.append(s)
                continue
            key = (t.dtype, t.device)
            start = cursor.get(key, 0)
            cursor[key] = start + -(-t.numel() // _ALIGN) * _ALIGN
            outs.append((key, start, t))
        need = {}
        for o in outs:
            if isinstance(o, tuple):
                need[o[0]] = max(need.get(o[0], 0), o[1] + o[2].numel())
        for key, n in need.items():
            a = self._arena.get(key)
            if a is None or a.numel() < n:
                self._arena[key] = torch.empty(n, dtype=key[0], device=key[1])
                self._scratch_version += 1
        return [o if isinstance(o, torch.Tensor) else self._arena[o[0]][o[1] : o[1] + o[2].numel()].view(o[2].shape)
                for o in outs]

    def _unit_plan(self, unit: int, todo: list[torch.nn.Parameter], dist: ProbeDist) -> ModelPlan:
        cleans = [p.data if p.data.is_contiguous() else p.data.contiguous() for p in todo]
        key = (unit, dist, tuple(id(p) for p in todo))
        sig = (self._scratch_version, *((c.data_ptr(), c.dtype) for c in cleans))
        hit = self._plans.get(key)
        if hit is None or hit[0] != sig:
            outs = self._scratch_for(todo)  # may reallocate scratch: the signature takes the new version
            sig = (self._scratch_version, *((c.data_ptr(), c.dtype) for c in cleans))
            hit = self._plans[key] = (sig, ModelPlan(cleans, [self.offsets[id(p)] for p in todo], dist, outs=outs))
        return hit[1]

    def _make_pre(self, unit: int, params: list[torch.nn.Parameter]):
        def pre(_module, _args):
            if self._probe is None:
                return
            seed, alpha, dist = self._probe
            todo = [p for p in params if id(p) not in self._live]
            if not todo:
                return
            plan = self._unit_plan(unit, todo, dist)
            for p, o in zip(todo, plan.perturb(seed, alpha)):
                self._live[id(p)] = (p, p.data)
                p.data = o

        return pre

    def _make_post(self, params: list[torch.nn.Parameter]):
        def post(_module, _args, _out):
            if self._probe is None:
                return
            for p in params:
                if id(p) not in self._shared and id(p) in self._live:
                    p.data = self._live.pop(id(p))[1]

        return post

    def _restore_all(self) -> None:
        for p, clean in self._live.values():
            p.data = clean
        self._live.clear()

    @torch.no_grad()
    def loss(self, batch, seed: int | None = None, alpha: float = 0.0,
             dist: ProbeDist | str = ProbeDist.GAUSS8) -> float:
        """L(theta + alpha * z(seed); batch) as a Python float; seed None or alpha 0 gives the clean loss.

        Raises TypeError/ValueError for a bad seed or distribution; the clean weights are restored even
        when loss_fn raises.
        """
        dist = as_dist(dist)
        if seed is None or alpha == 0.0:
            return float(self.loss_fn(self.model, batch))
        self._probe = (seed, float(alpha), dist)
        try:
            return float(self.loss_fn(self.model, batch))
        finally:
            self._probe = None
            self._restore_all()

    def clean_loss(self, batch) -> float:
        """L0 = L(theta; batch)."""
        return self.loss(batch)

    def losses(self, batch, seeds: Sequence[int], alpha: float,
               dist: ProbeDist | str = ProbeDist.GAUSS8) -> list[tuple[float, float]]:
        """[(L(theta + alpha z_s), L(theta - alpha z_s)) for s in seeds] on one shared batch."""
        return [(self.loss(batch, s, alpha, dist), self.loss(batch, s, -alpha, dist)) for s in seeds]

    @torch.no_grad()
    def loss_swapped(self, batch, new: dict[int, torch.Tensor] | None) -> float:
        """The loss with canonical block i (``canonical_offsets`` order) pointed at new[i] for one forward
        (None or {}: the clean loss); the clean storages are restored afterwards, even when loss_fn raises."""
        params = [p for _, p, _ in canonical_offsets(self.model)]
        saved = {i: params[i].data for i in (new or {})}
        try:
            for i, t in (new or {}).items():
                params[i].data = t
            return float(self.loss_fn(self.model, batch))
        finally:
            for i, t in saved.items():
                params[i].data = t

    def close(self) -> None:
        """Remove the hooks from the model and free the scratch."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._arena.clear()
        self._shared_scratch.clear()
        self._plans.clear()
