"""Pure-ZO training steps: MeZO, 1SPSA(K), 1.5-SPSA(K, α, λ) (DESIGN.md §2).

Each step draws K seeds from (run seed, step), gets L± (and L0 for 1.5-SPSA) from a ProbeBackend,
turns them into coefficients c_k (trainer.zo.updates.zo_coefficients) and applies
θ ← θ·(1 − lr·wd) + Σ_k c_k z(s_k) to fp32 master weights with the kernels' replay (so the update is a seed ledger: (step, seeds, c)).
The decay-then-replay order equals MeZO's θ − lr·(g·z + wd·θ) with wd evaluated at the old θ.
"""

from __future__ import annotations

from typing import Any

import torch

from probe_kernels import replay_model
from trainer.zo import estimators as est
from trainer.zo.backend import COUNT_KEYS, ProbeBackend, collect_round, losses
from trainer.zo.probes import RoundSpec, canonical_blocks
from trainer.zo.updates import ZOMethod as Method
from trainer.zo.updates import decoupled_decay_, zo_coefficients
from wire.bounds import PROBE_EPS

METHOD_DIST = {"mezo": "gauss8", "1spsa": "rademacher", "1.5spsa": "rademacher"}


class ZOStepper:
    """Holds fp32 masters of a model and applies pure-ZO steps to it.

    Args:
        model: module whose `named_parameters()` (canonical order) are trained; any float dtype.
        method: "mezo" (K forced to 1, gauss8 probes), "1spsa" or "1.5spsa" (Rademacher probes).
        run_seed: seeds of step t are estimators.step_seeds(run_seed, t, K).
        probes, eps, alpha, lam: K, ε, 1.5-SPSA α and λ.
        weight_decay: decoupled, applied to tensors with dim >= 2 only (GPT-2 recipe).
        timeout_s: how long a step waits for its round's results (0 for synchronous backends).
    Raises ValueError for an unknown method.
    """

    def __init__(self, model: torch.nn.Module, method: Method, *, run_seed: int, probes: int = 8,
                 eps: float = PROBE_EPS, alpha: float = 0.1, lam: float = 1.0, weight_decay: float = 0.0, timeout_s: float = 0.0) -> None:
        if method not in METHOD_DIST:
            raise ValueError(f"unknown ZO method {method!r}; use mezo, 1spsa or 1.5spsa")
        self.model, self.method, self.run_seed = model, method, run_seed
        self.k = 1 if method == "mezo" else probes
        self.eps, self.alpha, self.lam, self.weight_decay = eps, alpha, lam, weight_decay
        self.timeout_s = timeout_s
        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.dist = METHOD_DIST[method]
        blocks = canonical_blocks(model)
        self.params = [b.param for b in blocks]
        self.offsets = [b.offset for b in blocks]
        self.masters = [p.detach().float().clone() if p.dtype != torch.float32 else p.data for p in self.params]
        self.forward_passes = 0

    def probe_round(self, step: int, batch: Any) -> RoundSpec:
        """The round of step `step`: K seeded probes at version `step`, clean pass for 1.5-SPSA."""
        seeds = tuple(est.step_seeds(self.run_seed, step, self.k))
        return RoundSpec(f"zo-{step}", step, batch, self.eps, seeds, self.dist,
                          want_clean=self.method == "1.5spsa")

    @torch.no_grad()
    def step(self, step: int, batch: Any, backend: ProbeBackend, lr: float) -> dict[str, float]:
        """One ZO step at version `step`; returns loss (L0, or mean of L± without a clean pass) and stats."""
        r = self.probe_round(step, batch)
        res, counts = collect_round(backend, r, self.timeout_s)
        for k, v in counts.items():
            self.counts[k] += v
        lp, lm, l0 = losses(res)
        self.forward_passes += 2 * len(res) + (1 if r.want_clean else 0)
        c, stats = zo_coefficients(self.method, lp, lm, l0, self.eps, lr, self.alpha, self.lam)
        seeds, coeffs = list(r.seeds), [float(x) for x in c]
        decoupled_decay_(self.masters, lr, self.weight_decay)
        # One launch for the whole model on CUDA (bit-identical to per-tensor replay_: probe_kernels/parity.py);
        # per-tensor launches made MeZO's 2-forward steps launch-bound (experiments/headline/results/RESULTS.md).
        replay_model(self.masters, self.offsets, seeds, coeffs, self.dist)
        for p, w in zip(self.params, self.masters):
            if p.dtype != torch.float32:
                p.data.copy_(w)  # one rounding from the fp32 master
        self._publish_ledger(backend, step, seeds, coeffs, 1.0 - lr * self.weight_decay)
        loss = float(l0.mean()) if l0 is not None else float((lp + lm).mean() / 2)
        return {"loss": loss, "forward_passes": float(self.forward_passes),
                "update_coef_abs_mean": float(c.abs().mean()), **stats,
                **{f"probe_{k}": float(v) for k, v in self.counts.items()}}

    def _publish_ledger(self, backend: ProbeBackend, step: int, seeds: list[int], coeffs: list[float],
                        scale: float) -> None:
        """Publish version step + 1 as a seed-ledger entry on a backend that keeps them (the fleet's
        CoordinatorBackend: bytes instead of a snapshot per step; workers replay it bit-identically).

        Only when the entry is exact: every parameter is fp32 (workers replay onto fp32 masters) and the
        backend's last published version is `step` (else the next round publishes a snapshot, e.g. after
        a resume). The decay multiplies matrices only, as in `step`, hence scale_min_dim=2.
        """
        if backend.latest_version != step or any(p.dtype != torch.float32 for p in self.params):
            return
        backend.publish_ledger(step + 1, seeds, coeffs, self.dist, scale=scale if self.weight_decay else 1.0,
                               scale_min_dim=2)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON) for checkpoints: fp32 masters of non-fp32 params, forward-pass count."""
        tensors = {f"zo_master/{i}": w for i, (p, w) in enumerate(zip(self.params, self.masters))
                   if p.dtype != torch.float32}
        return tensors, {"forward_passes": self.forward_passes, "counts": dict(self.counts)}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `state()`; masters missing from `tensors` are re-read from the (loaded) model."""
        self.forward_passes = int(meta.get("forward_passes", 0))
        self.counts.update({k: int(v) for k, v in meta.get("counts", {}).items()})
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32:
                src = tensors.get(f"zo_master/{i}")
                self.masters[i] = (src if src is not None else p.detach()).float().clone()
