"""ZO-Curv optimizers: AdamW-family steps shaped by curvature estimated from ZO probes (DESIGN.md §2).

Every ZO-Curv method is one `torch.optim.Optimizer` here or in trainer.zo.role_rules, with AdamW semantics
(decoupled weight decay, bias-corrected moments, Loshchilov & Hutter 2019; the arithmetic in trainer.zo.updates),
fp32 master weights in its state when a parameter is not fp32, and the update rule's side of a curvature refresh
(the `CurvRule` protocol, driven by trainer.zo.modes.ZOCurvMode, whose trainer.zo.rounds.RoundBook runs the
rounds' lifecycle): `make_rounds` (the probe rounds of a refresh), `fold` (a refresh's completed rounds into the
rule's state), `refresh_stats`, `zo_state` / `load_zo_state`, and `history` / `publishes` (the weight versions its
rounds probe).

Blocks are parameter tensors in canonical order (`list(model.named_parameters())`); pass that list as
`blocks` when the param groups reorder them (e.g. decay / no-decay groups).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from probe_kernels import direction, dist_moments
from trainer.method_options import BlockOptions, LineOptions
from trainer.zo import estimators as est
from trainer.zo import updates as upd
from trainer.zo.backend import losses
from trainer.zo.curvature import CurvatureState
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from wire.bounds import PROBE_EPS

# Adam's ε: the denominator floor of the Adam-family updates here (torch.optim.AdamW's default), never a probe step
# (that is PROBE_EPS, wire.bounds). ZOSophia keeps Sophia's own 1e-12 (Liu et al. 2023).
ADAM_EPS = 1e-8

log = logging.getLogger("sparecycles.zo")
_FP32_LOSS_ULP = 2.0**-24  # relative rounding of an fp32 loss value
Refresh = list[tuple[RoundSpec, list[SeedResult]]]  # the rounds of one refresh, each with its results by seed


@dataclass(frozen=True)
class Probing:
    """How a ZO-Curv optimizer's curvature round is made: `probes` per round (K), their relative ε `probe_eps`
    (the probe's, not Adam's), and the `seed` the probes' seeds derive from (estimators.derive_seed)."""

    probes: int = 8
    probe_eps: float = PROBE_EPS
    seed: int = 0


class CurvRule(Protocol):
    """The update rule's side of a ZO-Curv refresh (every optimizer of this module and trainer.zo.role_rules).

    Attributes: block_sizes (numel per canonical block), history (weight versions its rounds need kept by the
    backend: 2 when they probe along θ_v − θ_base, else 0), log_prefix (the round counters' log names),
    last_clipped_frac (logged every step).
    """

    block_sizes: list[int]
    history: int
    log_prefix: str
    last_clipped_frac: float

    def publishes(self, step: int, interval: int) -> bool:
        """Whether the weights before optimizer step `step` must be published as version `step`."""
        ...

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """The rounds of a refresh at `version` on `batch` ([] when a version they need is not `published`)."""
        ...

    def fold(self, refresh: Refresh) -> dict[str, float]:
        """Fold one refresh's complete rounds into the rule's state; returns scalars to log."""
        ...

    def refresh_stats(self) -> dict[str, float]:
        """Scalars logged on every refresh step (curvature spread, multipliers)."""
        ...

    def zo_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON) of the rule's state for checkpoints (moments travel in the optimizer state)."""
        ...

    def load_zo_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `zo_state()`."""
        ...


class ZOCurvOptimizer(torch.optim.Optimizer):
    """Shared machinery: fp32 masters, block bookkeeping, the AdamW step with per-block multipliers, and a
    `CurvatureState` (None when `curv_size` is None) with the default `CurvRule` parts (one block-scaled round
    per refresh, folded through `_contribution`).

    Probe source: the curvature comes only from refreshes (trainer.zo.modes.refresh, which ZOCurvMode and every
    fleet run call: it marks the optimizer with `attach_probe_source`). Stepped without one (a plain torch loop) the
    multipliers stay 1.0 and the optimizer is AdamW: the first such `step` says so once, loudly (a UserWarning and a
    log WARNING); with `require_probes = True` it raises RuntimeError instead.
    """

    history = 0
    log_prefix = "curv"
    require_probes = False  # True: step() without a probe source raises instead of warning once

    def __init__(self, params, defaults: dict, *, blocks: Sequence[torch.Tensor] | None, curv_size: str | None,
                 curv_beta: float, probes: int, probe_eps: float, seed: int) -> None:
        super().__init__(params, defaults)
        flat = [p for g in self.param_groups for p in g["params"]]
        self.blocks = list(blocks) if blocks is not None else flat
        if {id(p) for p in self.blocks} != {id(p) for p in flat} or len(self.blocks) != len(flat):
            raise ValueError("`blocks` must list exactly the optimised parameters, once each, in canonical order")
        self.block_index = {id(p): i for i, p in enumerate(self.blocks)}
        self.block_sizes = [p.numel() for p in self.blocks]
        if probes < 1 or not probe_eps > 0:
            raise ValueError(f"need probes >= 1 and probe_eps > 0, got {probes}, {probe_eps}")
        self.probes, self.probe_eps, self.seed = probes, probe_eps, seed
        self.last_clipped_frac = 0.0
        n = sum(self.block_sizes) if curv_size == "coordinate" else len(self.blocks)
        self.curv = CurvatureState(n, beta=curv_beta) if curv_size is not None else None
        self.probe_source: str | None = None  # who issues this optimizer's probe rounds (attach_probe_source)
        self._said_no_probes = False

    def attach_probe_source(self, name: str) -> None:
        """Record that `name` (e.g. "refresh") issues this optimizer's probe rounds and folds them."""
        self.probe_source = name

    def _check_probe_source(self) -> None:
        """Refuse (`require_probes`) or say once that a step without a probe source is plain AdamW."""
        if self.probe_source is not None:
            return
        why = (f"{type(self).__name__}.step() without a probe source: no curvature probe round reaches it, so every "
               "multiplier stays 1.0 and it steps exactly as AdamW. Drive it through trainer.zo.modes.ZOCurvMode "
               "(or call trainer.zo.modes.refresh every curvature interval)")
        if self.require_probes:
            raise RuntimeError(why)
        if not self._said_no_probes:
            self._said_no_probes = True
            warnings.warn(why + "; set require_probes = True to make this an error", UserWarning, stacklevel=3)
            log.warning("%s", why)

    # ---- fp32 masters ---------------------------------------------------------------------------
    def _moments(self, p: torch.Tensor, *, second: bool) -> tuple[dict, torch.Tensor]:
        """(state, fp32 master) of `p` with its step counter advanced; first use creates the fp32 moment
        buffers (`exp_avg`, and `exp_avg_sq` when `second`), zero-initialised as in AdamW."""
        st, w = self.state[p], self._master(p)
        if "exp_avg" not in st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(w)
            if second:
                st["exp_avg_sq"] = torch.zeros_like(w)
        st["step"] += 1
        return st, w

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        if p.dtype == torch.float32:
            return p.data
        st = self.state[p]
        if "master" not in st:
            st["master"] = p.detach().float().clone()
        return st["master"]

    @staticmethod
    def _write_back(p: torch.Tensor, master: torch.Tensor) -> None:
        if p.dtype != torch.float32:
            p.data.copy_(master)  # one rounding from the fp32 master to the model dtype

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore like torch, but keep fp32 masters/moments fp32 (torch would cast them to the param dtype)."""
        # Keys are param indices (torch's own state_dict) or FQNs (torch.distributed.checkpoint's set_state_dict):
        # either way a key's position in the saved param groups is its param, as in torch's own load_state_dict.
        order = {k: i for i, k in enumerate(k for g in state_dict["param_groups"] for k in g["params"])}
        saved = {order[k]: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        flat = [p for g in self.param_groups for p in g["params"]]
        for idx, st in saved.items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor) and key != "step":
                    self.state[flat[idx]][key] = val.to(device=flat[idx].device, dtype=torch.float32).clone()

    # ---- the CurvRule defaults: one block-scaled round per refresh --------------------------------
    def publishes(self, step: int, interval: int) -> bool:
        """Block-scaled and coordinate rounds probe the live weights: nothing to publish."""
        return False

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """One round of K block-scaled probes, seeds derive_seed(seed, version, k), with the clean loss."""
        seeds = tuple(est.derive_seed(self.seed, version, k) for k in range(self.probes))
        return [RoundSpec(f"curv-{version}", version, batch, self.probe_eps, seeds, "rademacher",
                          want_clean=True, kind=ProbeKind.BLOCK_SCALED)]

    def _contribution(self, r: RoundSpec, res: list[SeedResult]) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-block mean diagonal curvature D_b = T̂_b / n_b from a block-scaled round, (B,) float64."""
        lp, lm, l0 = losses(res)
        h = est.curvature(lp, lm, l0, r.eps)
        a = torch.stack([est.block_scales(x.seed, len(self.blocks)) for x in res])
        c = est.leave_one_out_mean(h) if h.numel() > 1 else torch.zeros_like(h)
        m2, m4 = dist_moments("gauss8")
        d = est.block_trace_estimate(h, a, c, m2, m4) / torch.tensor(self.block_sizes, dtype=torch.float64)
        return d, _h_stats(h, l0, r.eps)

    def fold(self, refresh: Refresh) -> dict[str, float]:
        """Fold each round's contribution into the curvature EMA; returns the last one's h statistics."""
        stats: dict[str, float] = {}
        for r, res in refresh:
            contrib, stats = self._contribution(r, res)
            self.curv.fold(contrib)
        return stats

    def refresh_stats(self) -> dict[str, float]:
        """The curvature spread once a round was folded."""
        return _spread(self.curv.estimate) if self.curv.ready else {}

    def zo_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """({"curv_ema"}, the EMA's JSON fields)."""
        sd = self.curv.state_dict()
        return {"curv_ema": sd.pop("ema")}, sd

    def load_zo_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `zo_state()` (keys of other parts of a checkpoint's JSON are ignored)."""
        self.curv.load_state_dict({**meta, "ema": tensors["curv_ema"]})

    # ---- AdamW ---------------------------------------------------------------------------------
    def _multipliers(self) -> torch.Tensor:
        return torch.ones(len(self.blocks), dtype=torch.float64)

    def _block_lr(self, lr: float, b: int, s: Any) -> tuple[float, float | torch.Tensor, float | torch.Tensor]:
        """(lr, lr_scale, decay_scale) of block b for trainer.zo.updates.adamw_update_ given the group's lr and
        the multipliers `s` of `_multipliers()`: the step size of block b scaled by s_b, the decay not."""
        return lr, float(s[b]), 1.0

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step with per-block multipliers s_b from `_multipliers()` (via `_block_lr`):

        θ ← θ·(1 − lr·wd);  θ ← θ − lr·s_b·m̂/(√v̂ + eps)  (torch.optim.AdamW's op order; s_b = 1 → AdamW).
        """
        self._check_probe_source()
        loss = _closure_loss(closure)
        s = self._multipliers()
        for g, p in self._with_grads():
            st, w = self._moments(p, second=True)
            lr, lr_scale, decay_scale = self._block_lr(g["lr"], self.block_index[id(p)], s)
            upd.adamw_update_(w, p.grad.float(), st["exp_avg"], st["exp_avg_sq"], step=float(st["step"]),
                              hp=upd.AdamWHyper.of(g, lr), lr_scale=lr_scale, decay_scale=decay_scale)
            self._write_back(p, w)
        return loss

    def _with_grads(self):
        """(param group, parameter) for every parameter with a gradient, in param-group order."""
        return ((g, p) for g in self.param_groups for p in g["params"] if p.grad is not None)


def _closure_loss(closure):
    """torch.optim's closure convention: re-evaluate the loss with gradients enabled (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _h_stats(h: torch.Tensor, l0: torch.Tensor | None, eps: float) -> dict[str, float]:
    noise = float(l0.abs().max()) * _FP32_LOSS_ULP * math.sqrt(6.0) / eps**2 if l0 is not None else float("nan")
    return {"h_mean": float(h.mean()), "h_std": float(h.std()) if h.numel() > 1 else 0.0,
            "h_rounding_noise": noise}


def _spread(d: torch.Tensor) -> dict[str, float]:
    pos = d[d > 0]
    return {"curv_min": float(d.min()), "curv_median": float(d.median()), "curv_max": float(d.max()),
            "curv_frac_nonpositive": float((d <= 0).double().mean()),
            "curv_log10_spread": float(pos.log10().std()) if pos.numel() > 1 else 0.0}


class ZOCurvBlockAdamW(ZOCurvOptimizer):
    """ZO-Curv (a): AdamW whose step on block b is scaled by s_b = clip(ρ/D_b, s_min, s_max).

    D_b = EMA of tr(H_bb)/n_b from block-scaled probes z = Σ_b a_b r_b (estimator (h − c)(a_b² − 1)/(κ − 1),
    DESIGN.md §2, c the leave-one-out mean of h). ρ = None uses the median of the positive D_b, so the
    multiplier redistributes step size between blocks around 1; D_b <= 0 (no curvature seen) gives s_max.
    Before the first curvature round s_b = 1 (plain AdamW). Logs the fraction of clipped blocks.

    Args: params/lr/betas/eps/weight_decay as torch.optim.AdamW; blocks: canonical parameter list;
    options: trainer.method_options.BlockOptions (rho, s_min, s_max: the multiplier's knobs, validated
    0 < s_min <= 1 <= s_max; curv_beta: the CurvatureState's EMA); probing: the probe round (Probing: K
    block-scaled probes, seeds derive_seed(seed, version, k)).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks=None, options: BlockOptions | None = None, probing: Probing = Probing()) -> None:
        o = options or BlockOptions()
        self.rho, self.s_min, self.s_max = o.rho, o.s_min, o.s_max
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, blocks=blocks,
                         curv_size="block", curv_beta=o.curv_beta, probes=probing.probes,
                         probe_eps=probing.probe_eps, seed=probing.seed)

    def _multipliers(self) -> torch.Tensor:
        if not self.curv.ready:
            return super()._multipliers()
        s = upd.block_multipliers(self.curv.estimate, self.rho, self.s_min, self.s_max)
        self.last_clipped_frac = upd.clipped_fraction(s, self.s_min, self.s_max)
        return s


class ZOCurvSophia(ZOCurvOptimizer):
    """ZO-Curv (b): Sophia's clipped update with ZO curvature (Liu et al. 2023, Algorithm 3).

    m ← β1·m + (1 − β1)·g;  θ ← θ·(1 − lr·wd);  θ ← θ − lr·clip(m / max(γ·D, ε), −1, 1)
    with D the EMA (β2 = curv_beta) of the diagonal curvature estimated from probes: per block (D_b
    broadcast over the block, block-scaled probes) or per coordinate (gauss8 probes, D̂ = (h − c)(z⊙z − 1)
    /(κ − 1), DESIGN.md §2). Before the first round D = 0, so the step is lr·sign(m) as in Sophia with
    ĥ = 0. Logs the fraction of clipped coordinates.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.965, 0.99), gamma: float = 0.01, eps: float = 1e-12,
                 weight_decay: float = 0.1, *, blocks=None, granularity: str = "block",
                 probing: Probing = Probing()) -> None:
        if granularity not in ("block", "coordinate"):
            raise ValueError(f"granularity must be 'block' or 'coordinate', got {granularity!r}")
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.granularity = granularity
        super().__init__(params, {"lr": lr, "betas": betas, "gamma": gamma, "eps": eps, "weight_decay": weight_decay},
                         blocks=blocks, curv_size=granularity, curv_beta=betas[1], probes=probing.probes,
                         probe_eps=probing.probe_eps, seed=probing.seed)
        self.offsets = [0, *torch.tensor(self.block_sizes).cumsum(0).tolist()]

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """Per block: the block-scaled round; per coordinate: K gauss8 seeded probes with the clean loss."""
        if self.granularity == "block":
            return super().make_rounds(batch, version, published)
        seeds = tuple(est.derive_seed(self.seed, version, k) for k in range(self.probes))
        return [RoundSpec(f"curv-{version}", version, batch, self.probe_eps, seeds, "gauss8", want_clean=True)]

    def _contribution(self, r: RoundSpec, res: list[SeedResult]) -> tuple[torch.Tensor, dict[str, float]]:
        if self.granularity == "block":
            return super()._contribution(r, res)
        lp, lm, l0 = losses(res)
        h = est.curvature(lp, lm, l0, r.eps)
        z = torch.stack([direction(x.seed, 0, self.offsets[-1], "gauss8") for x in res])
        c = est.leave_one_out_mean(h) if h.numel() > 1 else torch.zeros_like(h)
        m2, m4 = dist_moments("gauss8")
        return est.diag_estimate(h, z, c, m2, m4), _h_stats(h, l0, r.eps)

    def _curvature_of(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if not self.curv.ready:
            return torch.zeros_like(like)
        d = self.curv.estimate
        if self.granularity == "block":
            return torch.full_like(like, float(d[i]))
        return d[self.offsets[i]:self.offsets[i + 1]].to(like.dtype).view_as(like)

    @torch.no_grad()
    def step(self, closure=None):
        """One Sophia step (formula in the class docstring) on fp32 masters."""
        self._check_probe_source()
        loss = _closure_loss(closure)
        clipped = total = 0
        for g, p in self._with_grads():
            st, w = self._moments(p, second=False)
            d = self._curvature_of(self.block_index[id(p)], w)
            clipped += upd.sophia_update_(w, p.grad.float(), st["exp_avg"], d, lr=g["lr"], beta1=g["betas"][0],
                                          gamma=g["gamma"], eps=g["eps"], weight_decay=g["weight_decay"])
            total += w.numel()
            self._write_back(p, w)
        self.last_clipped_frac = clipped / max(total, 1)
        return loss


class ZOCurvLine(ZOCurvOptimizer):
    """ZO-Curv (c): per-block Newton multiplier along the last update u_b = θ_v − θ_{v−1} (DESIGN.md §2).

    Probes L(θ_v ± ε·û_b) (û_b = u_b at unit RMS, τ_b = ‖u_b‖/√n_b) give the slope g_b and curvature h_b
    along the step. On the quadratic model along u_b the best step from θ_{v−1} was (1 − g_b/(h_b·τ_b))
    times the one taken, so the multiplier that produced u_b is rescaled by the ratio
    r_b = clip(1 − g_b/(h_b·τ_b), r_min, r_max) (r_max if h_b <= 0 and g_b < 0, r_min if h_b <= 0 and
    g_b >= 0) and the new target clip(s_b·r_b, s_min, s_max) enters an EMA; s_b starts at 1. The AdamW
    step on block b is then multiplied by s_b (as in ZOCurvBlockAdamW). Needs a backend holding θ_v and
    θ_{v−1}: the versions before and at each refresh are published (`publishes`), the backend keeps 2 (`history`).
    """

    history = 2

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks=None, options: LineOptions | None = None, probe_eps: float = PROBE_EPS,
                 seed: int = 0) -> None:
        o = options or LineOptions()  # validated 0 < s_min <= 1 <= s_max and 0 < r_min <= 1 <= r_max
        self.s_min, self.s_max, self.r_min, self.r_max = o.s_min, o.s_max, o.r_min, o.r_max
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, blocks=blocks,
                         curv_size="block", curv_beta=o.curv_beta, probes=1, probe_eps=probe_eps, seed=seed)

    def publishes(self, step: int, interval: int) -> bool:
        """θ_{v−1} and θ_v around each refresh v (a multiple of `interval`)."""
        return step % interval == 0 or (step + 1) % interval == 0

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """One probe per block along θ_version − θ_{version−1}; none while θ_{version−1} is not published."""
        if version - 1 not in published or version not in published:
            return []
        return [RoundSpec(f"line-{version}", version, batch, self.probe_eps, tuple(range(len(self.blocks))),
                          want_clean=True, kind=ProbeKind.ALONG_UPDATE, base_version=version - 1)]

    def _multipliers(self) -> torch.Tensor:
        if not self.curv.ready:
            return super()._multipliers()
        return self.curv.estimate

    def _contribution(self, r: RoundSpec, res: list[SeedResult]) -> tuple[torch.Tensor, dict[str, float]]:
        lp, lm, l0 = losses(res)
        g, h = est.slope(lp, lm, r.eps), est.curvature(lp, lm, l0, r.eps)
        tau = torch.tensor([x.scale or 0.0 for x in res], dtype=torch.float64)
        ratio = upd.line_ratios(g, h, tau, self.r_min, self.r_max)
        target = upd.line_multipliers(self._multipliers(), ratio, self.s_min, self.s_max)
        self.last_clipped_frac = upd.clipped_fraction(target, self.s_min, self.s_max)
        stats = _h_stats(h[tau > 0], l0, r.eps) if bool((tau > 0).any()) else {}
        stats["line_ratio_median"] = float(ratio.median())
        return target, stats
