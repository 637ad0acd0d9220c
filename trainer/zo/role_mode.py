"""Training-loop mode of the second-generation ZO-Curv variants (DESIGN.md §2 (d), (e); issue 17).

- ``zocurv-group``: per-role lr multipliers from group-restricted curvature probes (trainer.zo.role_adamw)
  every `curvature_interval` steps, on the first `probe_batch_size` sequences of the step's batch before
  it is trained on (fresh for θ_t). Probe budget per refresh = `probe_budget` forward-equivalents: one
  clean pass + 2 per probe, K = (budget − 1) // (2·roles) probes per role (at least 2 for an SNR).
- ``zocurv-global``: a global upward-only multiplier from a quadratic fit along d = θ_t − θ_{t−k},
  k = `curvature_interval`, at LINE_ALPHAS (α = −1 is θ_{t−k}). The losses come from one ``line`` probe
  round (trainer.zo.probes: seeds LINE_SEEDS at ε = LINE_EPS give α = ±½, ±1, ±1½, plus L0; 7 forward
  passes, the one at α = −1½ unused) through a ProbeBackend: in process by default (evaluated and folded
  before the step, as before), or the fleet's (fleet.backend.CoordinatorBackend: `sparecycles up`,
  `train --coordinator`), where the round is folded at the first step its results have arrived (at once
  with --fleet-sync, which makes the run equal the in-process one bit for bit). Each refresh publishes θ_t
  (the next round's base). On a fleet the record carries `publish_s` (the training thread's share: under
  `up` / `train --coordinator` the backend is CoordinatorBackend(background=True), whose publish only copies θ_t
  to pinned host buffers; serialisation, upload and the round follow in order on its upload thread),
  `publish_unix` and `publish_version`. (A thread of this mode's own that published from per-tensor copies while
  training went on was measured on two H200s, issue 21: the trainer's GPU at 32% SM, 3.4× AdamW's wall.)
- ``zocurv-group-global``: both.
- ``zocurv-group-fixed``: the zero-probe ablation, WANG2025_MULTIPLIERS fixed from step 0.
`eps` is relative for these modes: ε_G = eps·RMS(θ_G). Logged on refresh steps: ``mult_<role>``,
``curv_<role>``, ``snr_<role>``, ``mult_global``; when a line round is folded ``line_snr``, ``line_ratio``, ``line_version``; every step
``probe_forwards`` and ``probe_wall_s`` (cumulative; on a fleet the latter is the trainer's publish/submit time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.zo.backend import Collected, InProcessBackend, ProbeBackend
from trainer.zo.groups import Role, block_multipliers, model_roles
from trainer.zo.modes import backprop_step
from trainer.zo.multipliers import (
    WANG2025_MULTIPLIERS,
    line_ratio,
    quadratic_fit,
    update_global_multiplier,
    update_group_multipliers,
)
from trainer.zo.probes import ProbeKind, RoundSpec, SeedResult
from trainer.zo.role_adamw import RoleAdamW, group_curvatures

ROLE_METHODS = ("zocurv-group", "zocurv-global", "zocurv-group-global", "zocurv-group-fixed")
LINE_ALPHAS = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
LINE_EPS, LINE_SEEDS = 0.5, (1, 2, 3)  # the ``line`` round giving LINE_ALPHAS: α = ±j·LINE_EPS


def line_fit_losses(res: dict[int, SeedResult]) -> list[float]:
    """The losses at LINE_ALPHAS from a ``line`` round's results {seed j: result} (seeds LINE_SEEDS, want_clean).
    Raises KeyError for a missing seed, ValueError without the clean loss."""
    r1, r2, r3 = (res[j] for j in LINE_SEEDS)
    if r1.l0 is None:
        raise ValueError("a line round must want the clean loss (α = 0)")
    return [r2.l_minus, r1.l_minus, r1.l0, r1.l_plus, r2.l_plus, r3.l_plus]
# Multiplier knobs: trainer.methods.RoleOptions (--optimizer-option KEY=VALUE). Defaults: γ = ½ equalises the
# second-order cost of a sign-like step across groups (trainer.zo.multipliers); s_max = 10 is the top of
# Wang et al.'s table; refreshes with |SNR| < 2 leave a group's multiplier as it was.


class RoleCurvMode:
    """Backprop AdamW (RoleAdamW) whose per-role / global lr multipliers come from ZO probes (module docstring).

    Args: cfg (optimizer one of ROLE_METHODS), model (fp32), loss_fn(model, batch) -> scalar; backend: where the
    line rounds of zocurv-global run (None: in process on `model`, InProcessBackend(history=2)).
    Raises ValueError for another optimizer name, a model trainer.zo.groups cannot assign, or a backend for a
    variant with group probes (their GPT-2 role segments split blocks: no wire probe kind carries them yet).
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], backend: ProbeBackend | None = None) -> None:
        if cfg.optimizer not in ROLE_METHODS:
            raise ValueError(f"{cfg.optimizer!r} is not one of {ROLE_METHODS}")
        if backend is not None and cfg.optimizer != "zocurv-global":
            raise ValueError(f"{cfg.optimizer} probes in process only; of the role variants only zocurv-global "
                             "runs its rounds on a fleet")
        from trainer.methods import get_method

        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn
        self.opts = get_method(cfg.optimizer).parse_options(cfg.optimizer_options)
        self.gmap = model_roles(model)
        canonical = [p for _, p in model.named_parameters()]
        groups = [{"params": [p for p in canonical if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in canonical if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = RoleAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), blocks=canonical)
        name = cfg.optimizer
        self.group_probes = name in ("zocurv-group", "zocurv-group-global")
        self.line = name in ("zocurv-global", "zocurv-group-global")
        roles = self.gmap.roles
        self.mult = {r: 1.0 for r in roles}
        if name == "zocurv-group-fixed":
            self.mult = {r: WANG2025_MULTIPLIERS[r.value] for r in roles}
        self.per_role = max(2, (cfg.probe_budget - 1) // (2 * len(roles)))
        self.own_backend = backend is None
        self.backend = backend or InProcessBackend(model, loss_fn, history=2 if self.line else 0,
                                                   staleness=cfg.staleness)
        self.prev_version: int | None = None  # the version published at the last refresh (zocurv-global)
        self._pending: dict[str, RoundSpec] = {}  # line rounds submitted, not folded yet
        self._arrived: dict[str, dict[int, SeedResult]] = {}
        self.line_counts = {"accepted": 0, "stale": 0, "duplicate": 0, "dropped_rounds": 0}
        self.train_forwards = self.probe_forwards = 0
        self.probe_wall_s = 0.0  # seconds spent probing (would run on idle workers)
        self._apply()

    def _apply(self) -> None:
        devices = [p.device for p in self.model.parameters()]
        self.optimizer.block_mult = block_multipliers(self.gmap, self.mult, devices)

    def _probe_batch(self, batch: Any) -> Any:
        if isinstance(batch, tuple) and all(isinstance(t, torch.Tensor) for t in batch):
            return tuple(t[: self.cfg.probe_batch_size] for t in batch)
        return batch

    def refresh(self, step: int, batch: Any) -> dict[str, float]:
        """Probe at θ_step on `batch` and update the multipliers; returns the logged scalars."""
        t0 = self._clock()
        stats: dict[str, float] = {}
        refresh = step // self.cfg.curvature_interval
        if self.group_probes:
            est, extra, fwd = group_curvatures(self.model, self.loss_fn, batch, self.gmap, probes=self.per_role,
                                               eps_rel=self.cfg.eps, seed=self.cfg.seed, refresh=refresh)
            self.probe_forwards += fwd
            o = self.opts
            self.mult = update_group_multipliers(self.mult, est, gamma=o.gamma, s_max=o.s_max, beta=o.group_beta,
                                                 snr_min=o.snr_min, negative=o.negative)
            self._apply()
            for r, e in est.items():
                # SE = 0 (exactly quadratic losses) gives an infinite SNR; keep the JSON log standard
                stats.update({f"curv_{r.value}": e.mean, f"snr_{r.value}": max(min(e.snr, 1e12), -1e12)})
            stats.update({k: v for k, v in extra.items() if k.startswith("eps_")})
        if self.line:
            stats.update(self._submit_line(step, batch))
        stats.update({f"mult_{r.value}": float(v) for r, v in self.mult.items()})
        stats["mult_global"] = self.optimizer.global_mult
        self.probe_wall_s += self._clock() - t0
        return stats

    def _submit_line(self, step: int, batch: Any) -> dict[str, float]:
        """Publish θ_step and submit the line round along θ_step − θ_prev (none at the first refresh, nor after
        a resume on a fleet, whose coordinator run lacks θ_prev); rounds older than `staleness` versions that
        never completed are dropped. Returns the publish figures on a fleet ({} in process)."""
        stats: dict[str, float] = {}
        t0, unix0 = time.perf_counter(), time.time()
        self.backend.publish(step)
        if not self.own_backend:
            stats.update({"publish_s": time.perf_counter() - t0, "publish_unix": unix0, "publish_version": float(step)})
        if self.prev_version is not None and self.prev_version in self.backend.snapshots:
            r = RoundSpec(f"global-{step}", step, batch, LINE_EPS, LINE_SEEDS, want_clean=True, kind=ProbeKind.LINE,
                          base_version=self.prev_version)
            self._pending[r.round_id], self._arrived[r.round_id] = r, {}
            self.backend.submit(r)
        for rid, old in list(self._pending.items()):
            if step - old.version > self.cfg.staleness:
                del self._pending[rid], self._arrived[rid]
                self.line_counts["dropped_rounds"] += 1
        self.prev_version = step
        return stats

    def _fold(self, got: Collected) -> dict[str, float]:
        """Take collected line results; fold each completed round (in version order) into the global multiplier."""
        stats: dict[str, float] = {}
        for k in ("accepted", "stale", "duplicate"):
            self.line_counts[k] += got.counts.get(k, 0)
        for x in got.results:
            if x.round_id in self._arrived:
                self._arrived[x.round_id][x.seed] = x
            else:  # a round dropped here before its results came
                self.line_counts["stale"] += 1
                self.line_counts["accepted"] -= 1
        for rid, r in sorted(self._pending.items(), key=lambda kv: kv[1].version):
            if len(self._arrived[rid]) < len(r.seeds):
                continue
            fit = quadratic_fit(LINE_ALPHAS, line_fit_losses(self._arrived.pop(rid)))
            del self._pending[rid]
            ratio = line_ratio(fit)
            self.optimizer.global_mult = update_global_multiplier(self.optimizer.global_mult, ratio,
                                                                  m_max=self.opts.m_max, beta=self.opts.global_beta)
            stats.update({"line_ratio": ratio, "line_snr": fit.snr if math.isfinite(fit.snr) else 0.0,
                          "line_curv": fit.a, "line_slope": fit.b, "line_version": float(r.version)})
        if stats or got.results or any(got.counts.values()):
            stats.update({f"line_{k}": float(v) for k, v in self.line_counts.items()})
            stats["mult_global"] = self.optimizer.global_mult
        return stats

    def _clock(self) -> float:
        """Seconds, after the device's queued work finished (probe time is GPU time on CUDA)."""
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def step(self, step: int, batch: Any, lr: float) -> dict[str, float]:
        """Optimizer step `step` on `batch` at base lr `lr`; a refresh first every `curvature_interval` steps."""
        opt = self.optimizer
        for g in opt.param_groups:
            g["lr"] = lr
        stats: dict[str, float] = {}
        if step % self.cfg.curvature_interval == 0:  # the fixed ablation logs its (constant) multipliers too
            stats.update(self.refresh(step, self._probe_batch(batch)))
        if self._pending:  # in process: the round just submitted; on a fleet: whatever has arrived
            t0 = self._clock()
            stats.update(self._fold(self.backend.collect()))
            self.probe_wall_s += self._clock() - t0
        loss, gnorm = backprop_step(self.model, opt, self.loss_fn, batch, self.cfg.grad_clip)
        self.train_forwards += 1
        probe_forwards = self.probe_forwards + self.backend.forward_passes
        stats.update({"loss": loss, "grad_norm": gnorm, "clipped_frac": 0.0,
                      "forward_passes": float(self.train_forwards + probe_forwards),
                      "probe_forwards": float(probe_forwards), "probe_wall_s": self.probe_wall_s})
        return stats

    def extra_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Multipliers and counters (JSON); for zocurv-global θ at the last refresh (tensors) and its version.
        Rounds in flight are not kept (a resumed run submits afresh at its next refresh)."""
        snap = self.backend.snapshots.get(self.prev_version) if self.prev_version is not None else None
        tensors = {f"line_prev/{i}": t for i, t in enumerate(snap or [])}
        meta = {"mult": {r.value: v for r, v in self.mult.items()}, "global_mult": self.optimizer.global_mult,
                "train_forwards": self.train_forwards,
                "probe_forwards": self.probe_forwards + self.backend.forward_passes,
                "has_prev": snap is not None, "line_prev_version": self.prev_version}
        return tensors, meta

    def load_extra_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `extra_state()`. In process θ_prev comes back as the backend's snapshot, so the next round
        probes exactly as an uninterrupted run would; a fleet backend's new coordinator run lacks θ_prev, so its
        first refresh after a resume only publishes."""
        self.mult = {Role(k): float(v) for k, v in meta["mult"].items()}
        self.optimizer.global_mult = float(meta["global_mult"])
        self.train_forwards, self.probe_forwards = int(meta["train_forwards"]), int(meta["probe_forwards"])
        self.backend.forward_passes = 0
        prev = meta.get("line_prev_version")
        self.prev_version = int(prev) if prev is not None else None
        if meta.get("has_prev") and prev is not None and self.own_backend:
            n = len(list(self.model.parameters()))
            dev = next(self.model.parameters()).device  # checkpoints load on the CPU
            self.backend.snapshots = {int(prev): [tensors[f"line_prev/{i}"].to(dev) for i in range(n)]}
        self._apply()
