"""ZO-Curv optimizers: AdamW-family steps preconditioned by curvature estimated from ZO probes (DESIGN.md §2).

All three are `torch.optim.Optimizer`s with AdamW semantics (decoupled weight decay, bias-corrected
moments, Loshchilov & Hutter 2019), keep fp32 master weights in their state when a parameter is not
fp32, and add `refresh_curvature(backend, batch, version) -> stats`, which the training loop calls
every `curvature_interval` steps: it submits a probe round, folds every result that has arrived into a
versioned `CurvatureState` (staleness bound S on rounds; the backend judges single results) and returns
scalars to log.

Blocks are parameter tensors in canonical order (`list(model.named_parameters())`); pass that list as
`blocks` when the param groups reorder them (e.g. decay / no-decay groups).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from kernels import direction, dist_moments
from trainer.zo import estimators as est
from trainer.zo import updates as upd
from trainer.zo.backend import Collected, ProbeBackend, losses
from trainer.zo.curvature import CurvatureState, Outcome
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from trainer.zo.updates import block_multipliers, line_ratios  # noqa: F401  (public here too)

_FP32_LOSS_ULP = 2.0**-24  # relative rounding of an fp32 loss value


class _ZOCurvBase(torch.optim.Optimizer):
    """Shared machinery: fp32 masters, block bookkeeping, probe rounds and result intake."""

    kind: ProbeKind = ProbeKind.BLOCK_SCALED

    def __init__(self, params, defaults: dict, *, blocks: Sequence[torch.Tensor] | None, curv_size: str,
                 curv_beta: float, staleness: int, probes: int, probe_eps: float, seed: int) -> None:
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
        n = sum(self.block_sizes) if curv_size == "coordinate" else len(self.blocks)
        self.curv = CurvatureState(n, beta=curv_beta, staleness=staleness)
        self._pending: dict[str, RoundSpec] = {}
        self._arrived: dict[str, dict[int, SeedResult]] = {}
        self.dropped_rounds = 0

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
        saved = {int(k): dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        flat = [p for g in self.param_groups for p in g["params"]]
        for idx, st in saved.items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor) and key != "step":
                    self.state[flat[idx]][key] = val.to(device=flat[idx].device, dtype=torch.float32).clone()

    # ---- curvature rounds -----------------------------------------------------------------------
    def _make_round(self, batch: Any, version: int) -> RoundSpec:
        seeds = tuple(est.derive_seed(self.seed, version, k) for k in range(self.probes))
        return RoundSpec(f"curv-{version}", version, batch, self.probe_eps, seeds, "rademacher",
                          want_clean=True, kind=ProbeKind.BLOCK_SCALED)

    def _contribution(self, r: RoundSpec, res: list[SeedResult]) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-block mean diagonal curvature D_b = T̂_b / n_b from a block-scaled round, (B,) float64."""
        lp, lm, l0 = losses(res)
        h = est.curvature(lp, lm, l0, r.eps)
        a = torch.stack([est.block_scales(x.seed, len(self.blocks)) for x in res])
        c = est.leave_one_out_mean(h) if h.numel() > 1 else torch.zeros_like(h)
        m2, m4 = dist_moments("gauss8")
        d = est.block_trace_estimate(h, a, c, m2, m4) / torch.tensor(self.block_sizes, dtype=torch.float64)
        return d, _h_stats(h, l0, r.eps)

    def refresh_curvature(self, backend: ProbeBackend, batch: Any, version: int) -> dict[str, float]:
        """Submit a probe round at `version` on `batch` and fold every completed round into the state.

        The backend hands out results already judged (stale and duplicate ones removed, `intake`); a round
        is folded once all its seeds arrived; rounds gone stale before completing are dropped and counted. Returns h mean/std, rounding noise, curvature spread and the counters.
        """
        self.curv.set_version(version)
        if list(backend.block_sizes) != self.block_sizes:
            raise ValueError("backend blocks differ from the optimizer's: build both from the same model")
        r = self._make_round(batch, version)
        if r.round_id not in self._pending:  # else re-issued from a checkpoint (a step retried after an outage)
            backend.submit(r)  # pending only once sent: a submit that raised is sent again by the retried step
            self._pending[r.round_id] = r
            self._arrived[r.round_id] = {}
        return self.intake(backend.collect())

    def intake(self, got: Collected) -> dict[str, float]:
        """Take collected results and fold completed rounds; returns stats of what was folded.

        Which results count was decided by the backend's authority (the coordinator's intake, or
        InProcessBackend): its counts are added to `curv.counts`. A result of a round this optimizer no
        longer waits for (closed, or from before a resume) is counted stale.
        """
        stats: dict[str, float] = {}
        for k in self.curv.counts:
            self.curv.counts[k] += got.counts.get(k, 0)
        for x in got.results:
            if x.round_id not in self._pending:
                self.curv.counts[Outcome.STALE.value] += 1
                self.curv.counts[Outcome.ACCEPTED.value] -= 1
                continue
            self._arrived[x.round_id][x.seed] = x
        for rid, r in list(self._pending.items()):
            got_r = self._arrived[rid]
            if all(s in got_r for s in r.seeds):
                contrib, stats = self._contribution(r, [got_r[s] for s in r.seeds])
                self.curv.fold(contrib)
            elif self.curv.is_stale(r.version):
                self.dropped_rounds += 1
            else:
                continue
            del self._pending[rid], self._arrived[rid]
        stats.update({f"curv_{k}": float(v) for k, v in self.curv.counts.items()})
        stats["curv_dropped_rounds"] = float(self.dropped_rounds)
        stats["curv_pending_rounds"] = float(len(self._pending))
        if self.curv.ready:
            stats.update(_spread(self.curv.estimate))
        return stats

    def zo_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON) of the curvature state for checkpoints, with the rounds still in flight: each one's
        spec (JSON; its batch, when a tuple of tensors, as `round/<i>/batch/<j>`) and the results it already
        took. A resumed run re-issues them (trainer.zo.modes.ZOCurvMode) or forgets them (`drop_inflight`)."""
        sd = self.curv.state_dict()
        tensors = {"curv_ema": sd.pop("ema")}
        sd["dropped_rounds"] = self.dropped_rounds
        rounds = []
        for i, (rid, r) in enumerate(self._pending.items()):
            batch = isinstance(r.batch, tuple) and all(isinstance(t, torch.Tensor) for t in r.batch)
            if batch:
                tensors.update({f"round/{i}/batch/{j}": t.contiguous() for j, t in enumerate(r.batch)})
            rounds.append({"round_id": rid, "version": r.version, "eps": r.eps, "seeds": list(r.seeds),
                           "distribution": r.distribution, "want_clean": r.want_clean,
                           "kind": ProbeKind(r.kind).value, "base_version": r.base_version, "blocks": list(r.blocks),
                           "batch_len": len(r.batch) if batch else None,
                           "arrived": [dataclasses.asdict(x) for x in self._arrived[rid].values()]})
        sd["inflight"] = rounds
        return tensors, sd

    def load_zo_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `zo_state` returned; its rounds in flight are pending again (`inflight`), those whose
        batch was not saved are dropped. A checkpoint of an older format (no rounds kept) restores none."""
        meta = dict(meta)
        self.dropped_rounds = int(meta.pop("dropped_rounds", 0))
        rounds = meta.pop("inflight", [])
        self.curv.load_state_dict({**meta, "ema": tensors["curv_ema"]})
        self._pending.clear()
        self._arrived.clear()
        for i, d in enumerate(rounds):
            if d["batch_len"] is None:
                self.dropped_rounds += 1
                continue
            batch = tuple(tensors[f"round/{i}/batch/{j}"] for j in range(d["batch_len"]))
            # checkpoints written before the round fields took the wire's names say "dist" and "group"
            r = RoundSpec(d["round_id"], int(d["version"]), batch, float(d["eps"]), tuple(d["seeds"]),
                          d.get("distribution", d.get("dist")), want_clean=bool(d["want_clean"]),
                          kind=ProbeKind(d["kind"]), base_version=d["base_version"],
                          blocks=tuple(d.get("blocks", d.get("group", ()))))
            self._pending[r.round_id] = r
            self._arrived[r.round_id] = {int(x["seed"]): SeedResult(**x) for x in d["arrived"]}

    def inflight(self) -> list[RoundSpec]:
        """The rounds submitted and not yet folded nor dropped, oldest first."""
        return list(self._pending.values())

    def drop_inflight(self) -> None:
        """Forget the rounds in flight, counting each as dropped (a resume that cannot re-issue them)."""
        self.dropped_rounds += len(self._pending)
        self._pending.clear()
        self._arrived.clear()

    def take_early(self, got: Collected) -> None:
        """Take results of rounds in flight without folding anything (a resume's re-issued round: it folds at the
        next refresh, as in the uninterrupted run); the backend's counts are added to `curv.counts`."""
        for k in self.curv.counts:
            self.curv.counts[k] += got.counts.get(k, 0)
        for x in got.results:
            if x.round_id in self._pending:
                self._arrived[x.round_id][x.seed] = x
            else:  # as `intake`: a result of a round no longer waited for counts stale
                self.curv.counts[Outcome.STALE.value] += 1
                self.curv.counts[Outcome.ACCEPTED.value] -= 1

    # ---- AdamW ---------------------------------------------------------------------------------
    def _multipliers(self) -> torch.Tensor:
        return torch.ones(len(self.blocks), dtype=torch.float64)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step with per-block multipliers s_b from `_multipliers()`:

        θ ← θ·(1 − lr·wd);  θ ← θ − lr·s_b·m̂/(√v̂ + eps)  (torch.optim.AdamW's op order; s_b = 1 → AdamW).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        s = self._multipliers()
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st, w = self._moments(p, second=True)
                upd.adamw_update_(w, p.grad.float(), st["exp_avg"], st["exp_avg_sq"], step=float(st["step"]),
                                  lr=g["lr"], beta1=b1, beta2=b2, eps=g["eps"], weight_decay=g["weight_decay"],
                                  lr_scale=float(s[self.block_index[id(p)]]))
                self._write_back(p, w)
        return loss


def _h_stats(h: torch.Tensor, l0: torch.Tensor | None, eps: float) -> dict[str, float]:
    noise = float(l0.abs().max()) * _FP32_LOSS_ULP * math.sqrt(6.0) / eps**2 if l0 is not None else float("nan")
    return {"h_mean": float(h.mean()), "h_std": float(h.std()) if h.numel() > 1 else 0.0,
            "h_rounding_noise": noise}


def _spread(d: torch.Tensor) -> dict[str, float]:
    pos = d[d > 0]
    return {"curv_min": float(d.min()), "curv_median": float(d.median()), "curv_max": float(d.max()),
            "curv_frac_nonpositive": float((d <= 0).double().mean()),
            "curv_log10_spread": float(pos.log10().std()) if pos.numel() > 1 else 0.0}


class ZOCurvBlockAdamW(_ZOCurvBase):
    """ZO-Curv (a): AdamW whose step on block b is scaled by s_b = clip(ρ/D_b, s_min, s_max).

    D_b = EMA of tr(H_bb)/n_b from block-scaled probes z = Σ_b a_b r_b (estimator (h − c)(a_b² − 1)/(κ − 1),
    DESIGN.md §2, c the leave-one-out mean of h). ρ = None uses the median of the positive D_b, so the
    multiplier redistributes step size between blocks around 1; D_b <= 0 (no curvature seen) gives s_max.
    Before the first curvature round s_b = 1 (plain AdamW). Logs the fraction of clipped blocks.

    Args: params/lr/betas/eps/weight_decay as torch.optim.AdamW; blocks: canonical parameter list;
    rho, s_min, s_max: multiplier knobs (0 < s_min <= 1 <= s_max); curv_beta, staleness: CurvatureState;
    probes, probe_eps, seed: the probe round (K block-scaled probes, seeds derive_seed(seed, version, k)).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 *, blocks=None, rho: float | None = None, s_min: float = 0.5, s_max: float = 2.0,
                 curv_beta: float = 0.9, staleness: int = 2, probes: int = 8, probe_eps: float = 1e-3,
                 seed: int = 0) -> None:
        if not 0 < s_min <= 1 <= s_max:
            raise ValueError(f"need 0 < s_min <= 1 <= s_max, got {s_min}, {s_max}")
        self.rho, self.s_min, self.s_max = rho, s_min, s_max
        self.last_clipped_frac = 0.0
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, blocks=blocks,
                         curv_size="block", curv_beta=curv_beta, staleness=staleness, probes=probes,
                         probe_eps=probe_eps, seed=seed)

    def _multipliers(self) -> torch.Tensor:
        if not self.curv.ready:
            return super()._multipliers()
        s = upd.block_multipliers(self.curv.estimate, self.rho, self.s_min, self.s_max)
        self.last_clipped_frac = upd.clipped_fraction(s, self.s_min, self.s_max)
        return s


class ZOCurvSophia(_ZOCurvBase):
    """ZO-Curv (b): Sophia's clipped update with ZO curvature (Liu et al. 2023, Algorithm 3).

    m ← β1·m + (1 − β1)·g;  θ ← θ·(1 − lr·wd);  θ ← θ − lr·clip(m / max(γ·D, ε), −1, 1)
    with D the EMA (β2 = curv_beta) of the diagonal curvature estimated from probes: per block (D_b
    broadcast over the block, block-scaled probes) or per coordinate (gauss8 probes, D̂ = (h − c)(z⊙z − 1)
    /(κ − 1), DESIGN.md §2). Before the first round D = 0, so the step is lr·sign(m) as in Sophia with
    ĥ = 0. Logs the fraction of clipped coordinates.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.965, 0.99), gamma: float = 0.01, eps: float = 1e-12,
                 weight_decay: float = 0.1, *, blocks=None, granularity: str = "block", staleness: int = 2,
                 probes: int = 8, probe_eps: float = 1e-3, seed: int = 0) -> None:
        if granularity not in ("block", "coordinate"):
            raise ValueError(f"granularity must be 'block' or 'coordinate', got {granularity!r}")
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.granularity = granularity
        self.last_clipped_frac = 0.0
        super().__init__(params, {"lr": lr, "betas": betas, "gamma": gamma, "eps": eps, "weight_decay": weight_decay},
                         blocks=blocks, curv_size=granularity, curv_beta=betas[1], staleness=staleness,
                         probes=probes, probe_eps=probe_eps, seed=seed)
        self.offsets = [0, *torch.tensor(self.block_sizes).cumsum(0).tolist()]

    def _make_round(self, batch: Any, version: int) -> RoundSpec:
        if self.granularity == "block":
            return super()._make_round(batch, version)
        seeds = tuple(est.derive_seed(self.seed, version, k) for k in range(self.probes))
        return RoundSpec(f"curv-{version}", version, batch, self.probe_eps, seeds, "gauss8", want_clean=True)

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clipped = total = 0
        for g in self.param_groups:
            b1, _ = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st, w = self._moments(p, second=False)
                d = self._curvature_of(self.block_index[id(p)], w)
                clipped += upd.sophia_update_(w, p.grad.float(), st["exp_avg"], d, lr=g["lr"], beta1=b1,
                                              gamma=g["gamma"], eps=g["eps"], weight_decay=g["weight_decay"])
                total += w.numel()
                self._write_back(p, w)
        self.last_clipped_frac = clipped / max(total, 1)
        return loss


class ZOCurvLine(_ZOCurvBase):
    """ZO-Curv (c): per-block Newton multiplier along the last update u_b = θ_v − θ_{v−1} (DESIGN.md §2).

    Probes L(θ_v ± ε·û_b) (û_b = u_b at unit RMS, τ_b = ‖u_b‖/√n_b) give the slope g_b and curvature h_b
    along the step. On the quadratic model along u_b the best step from θ_{v−1} was (1 − g_b/(h_b·τ_b))
    times the one taken, so the multiplier that produced u_b is rescaled by the ratio
    r_b = clip(1 − g_b/(h_b·τ_b), r_min, r_max) (r_max if h_b <= 0 and g_b < 0, r_min if h_b <= 0 and
    g_b >= 0) and the new target clip(s_b·r_b, s_min, s_max) enters an EMA; s_b starts at 1. The AdamW
    step on block b is then multiplied by s_b (as in ZOCurvBlockAdamW). Needs a backend holding θ_v and
    θ_{v−1} (InProcessBackend(history >= 2), published every step).
    """

    kind = ProbeKind.ALONG_UPDATE

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 *, blocks=None, s_min: float = 0.25, s_max: float = 4.0, r_min: float = 0.5, r_max: float = 2.0,
                 curv_beta: float = 0.5, staleness: int = 2, probe_eps: float = 1e-3, seed: int = 0) -> None:
        if not (0 < s_min <= 1 <= s_max and 0 < r_min <= 1 <= r_max):
            raise ValueError("need 0 < s_min <= 1 <= s_max and 0 < r_min <= 1 <= r_max")
        self.s_min, self.s_max, self.r_min, self.r_max = s_min, s_max, r_min, r_max
        self.last_clipped_frac = 0.0
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, blocks=blocks,
                         curv_size="block", curv_beta=curv_beta, staleness=staleness, probes=1,
                         probe_eps=probe_eps, seed=seed)

    def _make_round(self, batch: Any, version: int) -> RoundSpec:
        if version < 1:
            raise ValueError("curvature along the update needs version >= 1 (a step must have been taken)")
        return RoundSpec(f"line-{version}", version, batch, self.probe_eps, tuple(range(len(self.blocks))),
                          want_clean=True, kind=ProbeKind.ALONG_UPDATE, base_version=version - 1)

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
