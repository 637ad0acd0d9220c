"""ZO-Curv second generation (DESIGN.md §2 (d), (e)): per-role and global lr multipliers, one optimizer.

`ZOCurvRoleAdamW` is AdamW where block b runs at lr·g·s_b (s_b a float, or a float32 tensor broadcast over the
block when GPT-2's fused c_attn carries QK and V columns, trainer.zo.groups; g a global multiplier). The multiplier
scales the whole per-element lr, weight decay included, exactly as separate AdamW parameter groups with those
lrs would (Wang et al. 2025 put each block type in its own group). It is a `CurvRule` of trainer.zo.optimizers,
driven by trainer.zo.modes.ZOCurvMode like every ZO-Curv method; its rounds are ordinary probe kinds, so they run
in process or on a fleet alike:

- ``zocurv-group`` (group probes): per role G one ``group`` round (trainer.zo.probes) of K Rademacher probes
  restricted to G (its blocks, c_attn's column slices) at ε_G = eps·RMS(θ_G), seeds
  derive_seed(seed, TAG_GROUP, refresh, role index, k); the first role's round carries the clean loss L0, shared
  by all (common random numbers): h_k = (L+ + L− − 2·L0)/ε_G², E h = tr(H_GG). K = (probe_budget − 1) // (2·roles)
  (at least 2, for an SNR), so a refresh costs 1 + 2·K·roles forward passes. The multipliers follow
  trainer.zo.multipliers.update_group_multipliers.
- ``zocurv-global`` (line rounds): one ``line`` round along d = θ_t − θ_{t−k}, k = `curvature_interval` (seeds
  LINE_SEEDS at ε = LINE_EPS give α = ±½, ±1, ±1½, plus L0: the losses at LINE_ALPHAS, α = −1 being θ_{t−k}), a
  quadratic fit, and an upward-only global multiplier. Each refresh publishes θ_t (the next round's base).
- ``zocurv-group-global``: both; ``zocurv-group-fixed``: the zero-probe ablation, WANG2025_MULTIPLIERS from step 0.

Logged on refresh steps: ``mult_<role>``, ``mult_global``; when group rounds fold ``curv_<role>``, ``snr_<role>``,
``eps_<role>``; when a line round folds ``line_ratio``, ``line_snr``, ``line_curv``, ``line_slope``, ``line_version``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.zo import estimators as est
from trainer.zo.groups import GroupMap, Role, block_multipliers
from trainer.zo.multipliers import (
    WANG2025_MULTIPLIERS,
    CurvEstimate,
    group_curvature,
    line_ratio,
    quadratic_fit,
    update_global_multiplier,
    update_group_multipliers,
)
from trainer.zo.optimizers import ADAM_EPS, Refresh, ZOCurvOptimizer
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from wire.bounds import PROBE_EPS

TAG_GROUP = 0x6A0C  # seed stream of the group probes
LINE_ALPHAS = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
LINE_EPS, LINE_SEEDS = 0.5, (1, 2, 3)  # the ``line`` round giving LINE_ALPHAS: α = ±j·LINE_EPS


def line_fit_losses(res: dict[int, SeedResult]) -> list[float]:
    """The losses at LINE_ALPHAS from a ``line`` round's results {seed j: result} (seeds LINE_SEEDS, want_clean).
    Raises KeyError for a missing seed, ValueError without the clean loss."""
    r1, r2, r3 = (res[j] for j in LINE_SEEDS)
    if r1.l0 is None:
        raise ValueError("a line round must want the clean loss (α = 0)")
    return [r2.l_minus, r1.l_minus, r1.l0, r1.l_plus, r2.l_plus, r3.l_plus]


def group_rms(params: Sequence[torch.Tensor], gmap: GroupMap, role: Role) -> float:
    """RMS of θ over the elements of `role` (segments honoured), float."""
    sq, n = 0.0, 0
    for seg in gmap.groups[role]:
        w = params[seg.block].detach().double()
        m = seg.mask(w.device)
        sq += float((w * w).sum() if m is None else (w * w)[m].sum())
        n += seg.numel
    return (sq / max(n, 1)) ** 0.5


def role_round(gmap: GroupMap, role: Role, **spec: Any) -> RoundSpec:
    """The ``group`` round perturbing exactly `role`'s elements: its blocks, with a slice per partial segment.
    `spec`: the other RoundSpec fields (round_id, version, batch, eps, seeds, want_clean)."""
    blocks, slices = gmap.probe_fields(role)
    return RoundSpec(**spec, distribution="rademacher", kind=ProbeKind.GROUP, blocks=blocks, slices=slices)


def group_estimates(refresh: Refresh, gmap: GroupMap) -> tuple[dict[Role, CurvEstimate], dict[str, float]]:
    """Per-role curvature from one refresh's ``group`` rounds (ids ending in "-<role>"; the one with L0 shares it).

    Returns ({role: CurvEstimate}, {"eps_<role>": ε_G}). Raises ValueError when no round carries the clean loss.
    """
    groups = [(r, res) for r, res in refresh if ProbeKind(r.kind) is ProbeKind.GROUP]
    l0 = next((res[0].l0 for r, res in groups if r.want_clean), None)
    if l0 is None:
        raise ValueError("a refresh's group rounds need one with the clean loss")
    out, eps = {}, {}
    for r, res in groups:
        role = Role(r.round_id.rsplit("-", 1)[1])
        out[role] = group_curvature([(x.l_plus + x.l_minus - 2 * l0) / r.eps**2 for x in res], gmap.size(role))
        eps[f"eps_{role.value}"] = r.eps
    return out, eps


class ScaledAdamW(ZOCurvOptimizer):
    """AdamW whose block b steps with lr·global_mult·block_mult[b] (module docstring), fp32 params only.

    θ ← θ·(1 − lr_b·wd);  θ ← θ − lr_b·m̂/(√v̂ + eps),  lr_b = lr·g·s_b  (torch.optim.AdamW's op order).

    Args: params/lr/betas/eps/weight_decay as torch.optim.AdamW; blocks: the canonical parameter list the
    multipliers index. Raises ValueError when `blocks` is not exactly the optimised parameters, TypeError for a
    non-fp32 parameter.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks: Sequence[torch.Tensor], probe_eps: float = PROBE_EPS, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, blocks=blocks,
                         curv_size=None, curv_beta=0.0, probes=1, probe_eps=probe_eps, seed=seed)
        if any(p.dtype != torch.float32 for p in self.blocks):
            raise TypeError(f"{type(self).__name__} keeps no fp32 masters: train fp32 weights")
        self.block_mult: list[float | torch.Tensor] = [1.0] * len(self.blocks)
        self.global_mult = 1.0

    def _multipliers(self) -> list[float | torch.Tensor]:
        return self.block_mult

    def _block_lr(self, lr: float, b: int, s: Any) -> tuple[float, float | torch.Tensor, float | torch.Tensor]:
        """The whole per-element lr scaled by g·s_b, decay included: a float multiplier folds into lr, a tensor one
        (c_attn's columns) scales the step and the decay alike."""
        lr = lr * self.global_mult
        if isinstance(s[b], torch.Tensor):
            return lr, s[b], s[b]
        return lr * s[b], 1.0, 1.0


@dataclass(frozen=True)
class RoleRounds:
    """Which rule of the family a ZOCurvRoleAdamW runs and how its rounds are made: `group_probes` (per-role group
    rounds: zocurv-group, -group-global), `line` (the global line round: zocurv-global, -group-global), `fixed`
    (start at Wang et al.'s multipliers: zocurv-group-fixed); `probe_budget` (forwards per refresh, shared by the
    roles), `probe_eps` (the probes' relative ε), `interval` (curvature_interval, steps) and `seed`."""

    group_probes: bool = False
    line: bool = False
    fixed: bool = False
    probe_budget: int = 3
    probe_eps: float = PROBE_EPS
    interval: int = 1
    seed: int = 0

    @classmethod
    def of(cls, cfg: Any) -> RoleRounds:
        """Those of a TrainConfig whose optimizer is one of the family."""
        name = cfg.optimizer
        return cls(group_probes=name in ("zocurv-group", "zocurv-group-global"),
                   line=name in ("zocurv-global", "zocurv-group-global"), fixed=name == "zocurv-group-fixed",
                   probe_budget=cfg.probe_budget, probe_eps=cfg.eps, interval=cfg.curvature_interval, seed=cfg.seed)


class ZOCurvRoleAdamW(ScaledAdamW):
    """ScaledAdamW whose multipliers come from ZO probes: the per-role and global rules (module docstring).

    Args: as ScaledAdamW, plus gmap: the blocks' roles (trainer.zo.groups.assign_roles); options:
    trainer.method_options.RoleOptions (None: only for a rule that folds no round); rounds: which variant and how
    its rounds are made (RoleRounds).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks: Sequence[torch.Tensor], gmap: GroupMap, options: Any, rounds: RoleRounds) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, blocks=blocks, probe_eps=rounds.probe_eps,
                         seed=rounds.seed)
        self.gmap, self.opts, self.interval = gmap, options, rounds.interval
        self.group_probes, self.line = rounds.group_probes, rounds.line
        self.history = 2 if rounds.line else 0
        self.log_prefix = "group" if rounds.group_probes else "line"
        self.per_role = max(2, (rounds.probe_budget - 1) // (2 * len(gmap.roles)))
        self.mult = {r: WANG2025_MULTIPLIERS[r.value] if rounds.fixed else 1.0 for r in gmap.roles}
        self._apply()

    def _apply(self) -> None:
        self.block_mult = block_multipliers(self.gmap, self.mult, [p.device for p in self.blocks])

    # ---- CurvRule ------------------------------------------------------------------------------
    def publishes(self, step: int, interval: int) -> bool:
        """zocurv-global: θ_t at each refresh t (the line rounds' endpoints)."""
        return self.line and step % interval == 0

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """The group rounds (one per role) and the line round along θ_version − θ_{version−k} (when published)."""
        out = []
        if self.group_probes:
            refresh = version // self.interval
            for ri, role in enumerate(self.gmap.roles):
                eps = self.probe_eps * max(group_rms(self.blocks, self.gmap, role), 1e-8)
                seeds = tuple(est.derive_seed(self.seed, TAG_GROUP, refresh, ri, k) for k in range(self.per_role))
                out.append(role_round(self.gmap, role, round_id=f"group-{version}-{role.value}", version=version,
                                      batch=batch, eps=eps, seeds=seeds, want_clean=ri == 0))
        base = version - self.interval
        if self.line and base in published and version in published:
            out.append(RoundSpec(f"global-{version}", version, batch, LINE_EPS, LINE_SEEDS, want_clean=True,
                                 kind=ProbeKind.LINE, base_version=base))
        return out

    def fold(self, refresh: Refresh) -> dict[str, float]:
        """Group rounds -> per-role multipliers; a line round -> the global multiplier."""
        stats: dict[str, float] = {}
        if any(ProbeKind(r.kind) is ProbeKind.GROUP for r, _ in refresh):
            est_, eps = group_estimates(refresh, self.gmap)
            o = self.opts
            self.mult = update_group_multipliers(self.mult, est_, gamma=o.gamma, s_max=o.s_max, beta=o.group_beta,
                                                 snr_min=o.snr_min, negative=o.negative)
            self._apply()
            for r, e in est_.items():
                # SE = 0 (exactly quadratic losses) gives an infinite SNR; keep the JSON log standard
                stats.update({f"curv_{r.value}": e.mean, f"snr_{r.value}": max(min(e.snr, 1e12), -1e12)})
            stats.update(eps)
        for r, res in refresh:
            if ProbeKind(r.kind) is ProbeKind.LINE:
                fit = quadratic_fit(LINE_ALPHAS, line_fit_losses({x.seed: x for x in res}))
                ratio = line_ratio(fit)
                self.global_mult = update_global_multiplier(self.global_mult, ratio, m_max=self.opts.m_max,
                                                            beta=self.opts.global_beta)
                stats.update({"line_ratio": ratio, "line_snr": fit.snr if math.isfinite(fit.snr) else 0.0,
                              "line_curv": fit.a, "line_slope": fit.b, "line_version": float(r.version)})
        return stats

    def refresh_stats(self) -> dict[str, float]:
        """The multipliers in force: ``mult_<role>`` and ``mult_global``."""
        return {**{f"mult_{r.value}": float(v) for r, v in self.mult.items()}, "mult_global": self.global_mult}

    def zo_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Multipliers (JSON)."""
        return {}, {"mult": {r.value: v for r, v in self.mult.items()}, "global_mult": self.global_mult}

    def load_zo_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `zo_state()`."""
        self.mult = {Role(k): float(v) for k, v in meta["mult"].items()}
        self.global_mult = float(meta["global_mult"])
        self._apply()
