"""ProbeEvaluator: L(theta + alpha * z(seed); batch) without touching the clean weights.

Each module's own parameters are swapped for perturbed scratch copies (``param.data = scratch``) by a
forward pre-hook just before the module runs and swapped back by its forward hook, so at most one
module's scratch is alive at a time -- except parameters owned by several modules (tied weights such as
GPT-2's wte/lm_head), whose scratch lives until the end of the forward so it is computed once. The clean
tensors are never written, so they stay bit-identical after any number of probes.

Limitation: a parameter read by code outside the forward of a module that owns it is seen clean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.dist import ProbeDist, as_dist
from kernels.ops import perturb


def canonical_offsets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    """(name, parameter, global offset) in canonical order = ``model.named_parameters()`` (tied weights once).

    Uses trainer.models.param_offsets when that module exists, so both agree by construction.
    """
    named = list(model.named_parameters())
    try:
        from trainer.models import param_offsets
    except ImportError:
        offs, acc = [], 0
        for _, p in named:
            offs.append(acc)
            acc += p.numel()
    else:
        offs = list(param_offsets(model))
    return [(n, p, o) for (n, p), o in zip(named, offs)]


class ProbeEvaluator:
    """Evaluates a model's loss at seeded perturbations theta + alpha * z(seed).

    model: any torch.nn.Module; loss_fn(model, batch) -> scalar tensor (e.g. mean token cross-entropy).
    Hooks are installed at construction and are inert outside `loss`; call `close()` to remove them.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], torch.Tensor]):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
        self.model, self.loss_fn = model, loss_fn
        self.offsets = {id(p): o for _, p, o in canonical_offsets(model)}
        self.numel = sum(p.numel() for _, p, _ in canonical_offsets(model))
        owners: dict[int, int] = {}
        self._owned: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
        for m in model.modules():
            ps = [p for _, p in m.named_parameters(recurse=False) if p is not None]
            if ps:
                self._owned.append((m, ps))
                for p in ps:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        self._shared = {pid for pid, k in owners.items() if k > 1}
        self._probe: tuple[int, float, ProbeDist] | None = None
        self._live: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._handles = []
        for m, ps in self._owned:
            self._handles.append(m.register_forward_pre_hook(self._make_pre(ps)))
            self._handles.append(m.register_forward_hook(self._make_post(ps)))

    def _make_pre(self, params: list[torch.nn.Parameter]):
        def pre(_module, _args):
            if self._probe is None:
                return
            seed, alpha, dist = self._probe
            for p in params:
                if id(p) in self._live:
                    continue
                clean = p.data
                self._live[id(p)] = (p, clean)
                p.data = perturb(clean, seed, self.offsets[id(p)], alpha, dist)

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

    def close(self) -> None:
        """Remove the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
