"""1.5-SPSA's published regime (issue 18) as pure functions, and a pure-ZO stepper with two weight numerics.

The published 1.5-SPSA runs (Chaubard, Kochenderfer, Ré; OPT-13B on SST-2) use: 1,000 training sentences
sampled with replacement into batches of 512, K = 40 Rademacher probes, α = 0.1, λ = 1, lr = ε = 1e-4, lr
and ε halved after a train-accuracy plateau of 50 iterations, weight decay 0, and bf16 weights perturbed in
place (+ε, −2ε, +ε per probe; no fp32 master). `PAPER` holds those numbers.

Pure functions (explicit seeds, no global RNG): `batch_rows` (with replacement), `plateau_update` (the
halving rule). `ZOParamStepper` runs MeZO / 1SPSA / 1.5-SPSA steps on a module with either
numerics="master" (fp32 masters, the project's path: probes read round(master) and write a scratch copy)
or numerics="inplace" (the public code's: the weights themselves are perturbed and restored, each
operation rounding once to the weights' dtype, and the update is applied probe by probe in place).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from probe_kernels import perturb_model, replay_model
from trainer.zo import estimators as est
from trainer.zo.probes import canonical_blocks
from trainer.zo.updates import zo_coefficients

TAG_PAPER_BATCH = 0xBA7C5  # derive_seed stream tag of the with-replacement batches
METHOD_DIST = {"mezo": "gauss8", "1spsa": "rademacher", "1.5spsa": "rademacher"}
Numerics = Literal["master", "inplace"]


@dataclass(frozen=True)
class PaperRegime:
    """The published 1.5-SPSA settings (issue 18). Units: sentences, iterations; lr/eps dimensionless."""

    n_train: int = 1000
    n_val: int = 500
    n_test: int = 1000
    batch_size: int = 512
    probes: int = 40
    alpha: float = 0.1
    lam: float = 1.0
    lr: float = 1e-4
    eps: float = 1e-4
    patience: int = 50  # iterations without a new best train accuracy before lr and eps are halved
    weight_decay: float = 0.0


PAPER = PaperRegime()


def batch_rows(seed: int, iteration: int, n: int, batch_size: int) -> torch.Tensor:
    """Rows (batch_size,) int64 in [0, n) of training batch `iteration`, drawn WITH replacement.

    A pure function of (seed, iteration): an explicit CPU torch.Generator seeded with
    estimators.derive_seed(seed, TAG_PAPER_BATCH, iteration) (never the global RNG), so any process
    recomputes any batch. Raises ValueError for n < 1, batch_size < 1 or a negative seed/iteration.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"need n >= 1 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    g = torch.Generator(device="cpu").manual_seed(est.derive_seed(seed, TAG_PAPER_BATCH, iteration))
    return torch.randint(0, n, (batch_size,), generator=g, dtype=torch.int64)


@dataclass(frozen=True)
class PlateauState:
    """State of the plateau rule: best train accuracy so far, iterations since it improved, halvings done."""

    best: float = -math.inf
    since: int = 0
    halvings: int = 0

    @property
    def scale(self) -> float:
        """Factor on the starting lr and eps: 0.5 ** halvings."""
        return 0.5 ** self.halvings


def plateau_update(state: PlateauState, train_acc: float, patience: int = PAPER.patience) -> PlateauState:
    """The next PlateauState after one iteration's train accuracy (pure).

    A strictly better accuracy resets the counter; otherwise it counts up, and when it reaches `patience`
    the step sizes are halved (halvings + 1) and the counter restarts (the best is kept). So with a flat
    accuracy the halvings happen after iterations patience, 2·patience, ... Raises ValueError for
    patience < 1 or a non-finite accuracy.
    """
    if patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    if not math.isfinite(train_acc):
        raise ValueError(f"train accuracy must be finite, got {train_acc}")
    if train_acc > state.best:
        return PlateauState(train_acc, 0, state.halvings)
    since = state.since + 1
    if since >= patience:
        return PlateauState(state.best, 0, state.halvings + 1)
    return PlateauState(state.best, since, state.halvings)


def inplace_perturb_(tensors: list[torch.Tensor], offsets: list[int], seed: int, alpha: float,
                     dist: str = "rademacher") -> None:
    """tensors[i] <- round_dtype(fp32(tensors[i]) + fp32(alpha) * z(seed)[offsets[i] :]) in place, one rounding
    per element to each tensor's own dtype (probe_kernels.perturb_model with outs aliasing the inputs; the kernels'
    reference arithmetic, probe_kernels.reference). In bf16 the +ε, −2ε, +ε cycle does not restore the weights
    exactly: that is the drift `ZOParamStepper(numerics="inplace")` accumulates."""
    perturb_model(tensors, offsets, seed, alpha, dist, outs=tensors)


class ZOParamStepper:
    """Pure-ZO steps (mezo / 1spsa / 1.5spsa) on `model` with explicit weight numerics.

    Args:
        model: module whose canonical parameters are trained (any float dtype; bf16 for the paper's numerics).
        method: "mezo" (K = 1, gauss8), "1spsa" or "1.5spsa" (Rademacher).
        numerics: "master" keeps fp32 masters M (weights = round(M) after each step) and probes a scratch
            copy (shadow module) perturbed from the clean weights; "inplace" perturbs the weights themselves
            (+ε, −2ε, +ε) and applies c_k·z_k probe by probe, rounding each time (no master).
        run_seed, probes, alpha, lam: as trainer.zo.zo_step.ZOStepper (seeds estimators.step_seeds).
    Step losses are the loss function's floats; `step` returns the coefficient statistics of
    trainer.zo.updates.zo_coefficients (1.5-SPSA: h_mean, h_std, w_mean, frac_weight_floored).
    Raises ValueError for an unknown method or numerics.
    """

    def __init__(self, model: torch.nn.Module, method: str, *, numerics: Numerics = "master", run_seed: int = 0,
                 probes: int = PAPER.probes, alpha: float = PAPER.alpha, lam: float = PAPER.lam) -> None:
        if method not in METHOD_DIST:
            raise ValueError(f"unknown ZO method {method!r}; use mezo, 1spsa or 1.5spsa")
        if numerics not in ("master", "inplace"):
            raise ValueError(f"numerics must be 'master' or 'inplace', got {numerics!r}")
        self.model, self.method, self.numerics, self.run_seed = model, method, numerics, run_seed
        self.k = 1 if method == "mezo" else probes
        self.alpha, self.lam, self.dist = alpha, lam, METHOD_DIST[method]
        blocks = canonical_blocks(model)
        self.params = [b.param.data for b in blocks]
        self.offsets = [b.offset for b in blocks]
        self.forward_passes = 0
        if numerics == "master":
            # fp32 weights are their own masters (as ZOStepper); other dtypes get an fp32 copy
            self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
            self.shadow = copy.deepcopy(model).eval()
            self.scratch = [b.param.data for b in canonical_blocks(self.shadow)]

    def _loss(self, module: torch.nn.Module, loss_fn, batch) -> float:
        self.forward_passes += 1
        return float(loss_fn(module, batch))

    def _probe(self, loss_fn, batch, seed: int, eps: float) -> tuple[float, float]:
        """(L(θ+εz), L(θ−εz)) for probe `seed`."""
        if self.numerics == "master":
            perturb_model(self.params, self.offsets, seed, eps, self.dist, outs=self.scratch)
            lp = self._loss(self.shadow, loss_fn, batch)
            perturb_model(self.params, self.offsets, seed, -eps, self.dist, outs=self.scratch)
            return lp, self._loss(self.shadow, loss_fn, batch)
        inplace_perturb_(self.params, self.offsets, seed, eps, self.dist)
        lp = self._loss(self.model, loss_fn, batch)
        inplace_perturb_(self.params, self.offsets, seed, -2.0 * eps, self.dist)
        lm = self._loss(self.model, loss_fn, batch)
        inplace_perturb_(self.params, self.offsets, seed, eps, self.dist)
        return lp, lm

    @torch.no_grad()
    def apply(self, seeds: list[int], coeffs: list[float]) -> None:
        """The update θ ← θ + Σ_k c_k z(s_k) of one step (what `step` applies after its probes): master
        numerics replay it on the fp32 masters (probe_kernels.replay_model) and round into the weights; inplace
        numerics add c_k z_k probe by probe. Replaying a run's (seeds, coeffs) ledger with `apply` from the
        same start gives the run's weights again (master numerics: bit for bit, the same kernel calls)."""
        if self.numerics == "master":
            replay_model(self.masters, self.offsets, list(seeds), list(coeffs), self.dist)
            for p, m in zip(self.params, self.masters):
                if p.dtype != torch.float32:
                    p.copy_(m)  # one rounding from the fp32 master
        else:
            for s, ck in zip(seeds, coeffs):
                inplace_perturb_(self.params, self.offsets, int(s), float(ck), self.dist)

    @torch.no_grad()
    def fingerprint(self) -> float:
        """Σ of every trained weight in fp64 (a float): equal for equal weights, so a replayed resume can be
        checked against the run it continues (one fp32 ulp of one weight moves it in practice)."""
        return float(sum(p.double().sum() for p in self.params))

    @torch.no_grad()
    def step(self, step: int, batch: Any, loss_fn, lr: float, eps: float) -> dict[str, Any]:
        """One step at step sizes (lr, eps): L0 (1.5-SPSA), K probes, θ ← θ + Σ_k c_k z(s_k).

        Returns {"loss" (L0, or mean of L± without a clean pass), "forward_passes" (cumulative),
        "seeds", "coeffs", **zo_coefficients' stats}. Raises ValueError for eps <= 0.
        """
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        seeds = est.step_seeds(self.run_seed, step, self.k)
        l0 = self._loss(self.model, loss_fn, batch) if self.method == "1.5spsa" else None
        pairs = [self._probe(loss_fn, batch, s, eps) for s in seeds]
        lp = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
        lm = torch.tensor([b for _, b in pairs], dtype=torch.float64)
        l0t = None if l0 is None else torch.full((self.k,), l0, dtype=torch.float64)
        c, stats = zo_coefficients(self.method, lp, lm, l0t, eps, lr, self.alpha, self.lam)
        coeffs = [float(x) for x in c]
        self.apply(seeds, coeffs)
        loss = l0 if l0 is not None else float((lp + lm).mean() / 2)
        return {"loss": loss, "forward_passes": self.forward_passes, "seeds": seeds, "coeffs": coeffs, **stats}


@torch.no_grad()
def numerics_drift(weights: list[torch.Tensor], offsets: list[int], ledger: list[tuple[list[int], list[float], float]],
                   dist: str = "rademacher") -> dict[str, float]:
    """Weight drift of bf16-in-place numerics against the fp32-master path, replaying one step ledger.

    weights: the starting weights W0 (any float dtype, e.g. bf16; not modified). ledger: per step (seeds,
    coeffs, eps), e.g. recorded from a run. Three paths from W0, all with the same seeds and coefficients:
      master:  M ← M + Σ_k c_k z_k in fp32 (probe_kernels.replay_model), weights round(M);
      inplace: per probe the +ε, −2ε, +ε cycle (each rounding to W0's dtype), then w ← round(w + c_k z_k)
               probe by probe (the public code's order);
      restore: the +ε, −2ε, +ε cycles alone (no update): what perturb/restore leaves behind.
    Returns {"steps", "cycles" (perturb/restore cycles), "restore_changed_frac" (elements of the restore
    path that differ from W0), "restore_rel_l2" (‖restore − W0‖/‖W0‖), "update_rel_l2_master"
    (‖round(M) − W0‖/‖W0‖), "update_rel_l2_inplace" (‖inplace − W0‖/‖W0‖), "inplace_vs_master_rel"
    (‖inplace − round(M)‖ / ‖round(M) − W0‖, inf when the master did not move), "inplace_vs_master_changed_frac"}.
    Norms in fp64. Raises ValueError for eps <= 0 or mismatched ledger entries.
    """
    w0 = [w.detach().clone() for w in weights]
    master = [w.detach().float().clone() for w in weights]
    inplace = [w.detach().clone() for w in weights]
    restore = [w.detach().clone() for w in weights]
    cycles = 0
    for seeds, coeffs, eps in ledger:
        if len(seeds) != len(coeffs) or not eps > 0:
            raise ValueError(f"a ledger entry needs one coefficient per seed and eps > 0, got {len(seeds)} seeds, "
                             f"{len(coeffs)} coefficients, eps {eps}")
        replay_model(master, offsets, list(seeds), list(coeffs), dist)
        for s in seeds:
            for path in (inplace, restore):
                for a in (eps, -2.0 * eps, eps):
                    inplace_perturb_(path, offsets, int(s), a, dist)
            cycles += 1
        for s, ck in zip(seeds, coeffs):
            inplace_perturb_(inplace, offsets, int(s), float(ck), dist)
    rounded = [m.to(w.dtype) for m, w in zip(master, w0)]

    def sq(xs, ys) -> float:
        return float(sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(xs, ys)))

    def changed(xs, ys) -> float:
        return float(sum(int((x != y).sum()) for x, y in zip(xs, ys)) / max(1, sum(x.numel() for x in xs)))

    n0 = math.sqrt(float(sum((w.double() ** 2).sum() for w in w0))) or 1.0
    moved = math.sqrt(sq(rounded, w0))
    return {"steps": len(ledger), "cycles": cycles, "restore_changed_frac": changed(restore, w0),
            "restore_rel_l2": math.sqrt(sq(restore, w0)) / n0, "update_rel_l2_master": moved / n0,
            "update_rel_l2_inplace": math.sqrt(sq(inplace, w0)) / n0,
            "inplace_vs_master_rel": math.sqrt(sq(inplace, rounded)) / moved if moved else math.inf,
            "inplace_vs_master_changed_frac": changed(inplace, rounded)}
