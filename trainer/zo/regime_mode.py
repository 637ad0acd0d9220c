"""The block-type lr methods (per-role learning rates at large batch): AdamW (ScaledAdamW) at per-role multipliers, as ZO-Curv update rules
(trainer.zo.optimizers.CurvRule) that trainer.zo.modes.ZOCurvMode drives like every ZO-Curv method, so their probe
rounds run in process or on a fleet alike (the mode's backend and trainer.zo.rounds.RoundBook's fold timing).

- ``zocurv-static`` (`BlockTableAdamW`): Wang et al.'s table, fixed, no probes (trainer.zo.block_table; normalised
  by its parameter-weighted geometric mean by default, so the base lr means what AdamW's does).
- ``zocurv-trust`` (`TrustRegionAdamW`): the calibrated block trust region (trainer.zo.trust_region): every
  `curvature_interval` steps t (after warmup), per role, the loss along that role's share of θ_t − θ_prev
  (θ_prev: the previous refresh's weights) at DESIGN_ALPHAS on `batches` held-out batches of `probe_batch_size`
  sequences: B·R ``group_line`` rounds (trainer.zo.group_line; θ_t and θ_prev published as versions t and
  t − curvature_interval). The multipliers start at the static table (option start="table") or at 1
  (start="one") and move only after `agree` consecutive refreshes with |z| > `z_min` of one sign. Folding starts
  after warmup (the lr still rises there, so "longer steps" is what every fit would say). In process the rounds
  fold at their own refresh; on a fleet (`train --coordinator`, `up`) when the mode's timing says (async: at the
  first refresh after all of a refresh's results arrived, the trainer never waiting for them).

Held-out probe batches: random windows (seed stream TAG_PROBE, one index per refresh and batch) of the
corpus's selection split when it has one (`Corpus.select`: the split that chooses, never the one reported;
classics-large has it), else of its validation split; the reported validation loss reads a fixed evenly spaced subset of
the same split, so on a corpus without a selection split the fits may see some of those windows (they choose
R ≈ 5 scalars per refresh).
Logged on refresh steps: mult_<role>; when a refresh folds also tr_r_<role> (exp of the mean log-ratio),
tr_z_<role>, tr_streak_<role>, tr_version (the refresh folded); the mode adds probe_forwards, probe_wall_s and the
round counters trust_accepted|stale|duplicate|dropped_rounds|pending_rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.data import get_batch, load_corpus
from trainer.method_options import RegimeOptions
from trainer.zo import estimators as est
from trainer.zo.block_table import table_multipliers
from trainer.zo.group_line import DESIGN_EPS, group_line_rounds, group_line_table
from trainer.zo.groups import GroupMap, Role, assign_roles, block_multipliers
from trainer.zo.optimizers import ADAM_EPS, Refresh
from trainer.zo.probes import RoundSpec
from trainer.zo.role_rules import ScaledAdamW
from trainer.zo.trust_region import DESIGN_ALPHAS, TrustRegion, TrustRegionRule, fit_role

if TYPE_CHECKING:
    from trainer.config import TrainConfig

REGIME_METHODS = ("zocurv-static", "zocurv-trust")
TAG_PROBE = 0x7E61  # seed stream of the held-out probe batches
ProbeSource = Callable[[int, int], Any]  # (refresh index, batch index) -> a held-out batch for the loss function


def held_out_source(cfg: TrainConfig) -> ProbeSource:
    """source(refresh, b) -> (x, y) int64 (probe_batch_size, seq_len) on cfg.device: window index
    refresh·batches + b of the corpus's selection split (validation without one), seed stream TAG_PROBE. The corpus
    loads on the first call."""
    batches = RegimeOptions(**cfg.optimizer_options).batches
    tokens: list[Any] = []

    def source(refresh: int, b: int) -> Any:
        if not tokens:
            corpus = load_corpus(cfg.corpus)
            tokens.append(corpus.val if corpus.select is None else corpus.select)
        x, y = get_batch(tokens[0], cfg.probe_batch_size, cfg.seq_len, est.derive_seed(cfg.seed, TAG_PROBE),
                         refresh * batches + b)
        return x.to(cfg.device), y.to(cfg.device)

    return source


class BlockTableAdamW(ScaledAdamW):
    """ScaledAdamW at fixed per-role multipliers `mult` (``zocurv-static``): a CurvRule without rounds.

    Args: as ScaledAdamW, plus gmap (the blocks' roles, trainer.zo.groups) and mult ({role: multiplier}; roles
    missing get 1). Raises what ScaledAdamW raises.
    """

    log_prefix = "static"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks: Sequence[torch.Tensor], gmap: GroupMap, mult: dict[Role, float]) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, blocks=blocks)
        self.gmap = gmap
        self.region: TrustRegion[Role] = TrustRegion(dict(mult))
        self._apply()

    @property
    def mult(self) -> dict[Role, float]:
        """The current per-role multipliers."""
        return self.region.mult

    def _apply(self) -> None:
        self.block_mult = block_multipliers(self.gmap, self.region.mult, [p.device for p in self.blocks])

    # ---- CurvRule -----------------------------------------------------------------------------------
    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """None: the table is fixed."""
        return []

    def fold(self, refresh: Refresh) -> dict[str, float]:
        """Nothing to fold (no rounds)."""
        return {}

    def refresh_stats(self) -> dict[str, float]:
        """The multipliers in force, ``mult_<role>``."""
        return {f"mult_{r.value}": float(v) for r, v in self.region.mult.items()}

    def zo_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Multipliers and streaks (JSON)."""
        return {}, self.region.state()

    def load_zo_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore `zo_state()`."""
        self.region.mult = {Role(k): float(v) for k, v in meta["mult"].items()}
        self.region.streak = {Role(k): int(v) for k, v in meta["streak"].items()}
        self._apply()


@dataclass(frozen=True)
class TrustRounds:
    """zocurv-trust's region and its held-out rounds: `rule` (trainer.zo.trust_region.TrustRegionRule), `batches`
    (held-out batches per refresh, >= 2 for an across-batch SE), `interval` (curvature_interval, steps, >= 1),
    `warmup` (warmup_steps: no rounds before), `source(refresh, b)` -> a held-out batch (`held_out_source`).
    Raises ValueError for batches < 2 or interval < 1."""

    rule: TrustRegionRule
    batches: int
    interval: int
    warmup: int
    source: ProbeSource

    def __post_init__(self) -> None:
        if self.batches < 2 or self.interval < 1:
            raise ValueError(f"need batches >= 2 and interval >= 1, got {self.batches}, {self.interval}")


class TrustRegionAdamW(BlockTableAdamW):
    """``zocurv-trust``: BlockTableAdamW whose multipliers the calibrated trust region moves (module docstring).

    Args: as BlockTableAdamW (mult: the start), plus trust: the region's rule and its rounds (TrustRounds).
    """

    history = 2  # θ_t and θ_prev published
    log_prefix = "trust"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = ADAM_EPS, weight_decay: float = 0.1,
                 *, blocks: Sequence[torch.Tensor], gmap: GroupMap, mult: dict[Role, float],
                 trust: TrustRounds) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, blocks=blocks, gmap=gmap, mult=mult)
        self.region.rule = trust.rule
        self.batches, self.interval, self.warmup, self.source = trust.batches, trust.interval, trust.warmup, trust.source

    def publishes(self, step: int, interval: int) -> bool:
        """θ_t at each refresh t whose weights a round probes, as θ_t or as the next refresh's θ_prev."""
        return step % interval == 0 and step + interval >= self.warmup

    def make_rounds(self, batch: Any, version: int, published: Collection[int]) -> list[RoundSpec]:
        """The refresh's B·R ``group_line`` rounds at `version` along θ_version − θ_{version − interval} on held-out
        batches (`batch`, the training batch, is not used); none before warmup or while either is not published."""
        base = version - self.interval
        if version < self.warmup or base not in published or version not in published:
            return []
        refresh = version // self.interval
        held = [self.source(refresh, b) for b in range(self.batches)]
        return group_line_rounds(self.gmap, held, version, base, DESIGN_ALPHAS, DESIGN_EPS, prefix="trust")

    def fold(self, refresh: Refresh) -> dict[str, float]:
        """One refresh's rounds -> per-role fits (trainer.zo.trust_region.fit_role) -> the region's update."""
        o = self.region.rule
        table = group_line_table(refresh, DESIGN_ALPHAS, DESIGN_EPS)
        fits = {r: fit_role(DESIGN_ALPHAS, v, r_min=o.r_min, r_max=o.r_max) for r, v in table.items()}
        self.region.update(fits)
        self._apply()
        stats = {"tr_version": float(refresh[0][0].version)}
        for r, f in fits.items():
            stats.update({f"tr_r_{r.value}": math.exp(f.log_ratio), f"tr_z_{r.value}": max(min(f.z, 1e12), -1e12),
                          f"tr_streak_{r.value}": float(self.region.streak.get(r, 0))})
        return stats


def build_regime_rule(groups: list[dict], blocks: list[Any], cfg: TrainConfig, o: RegimeOptions,
                      source: ProbeSource | None = None) -> BlockTableAdamW:
    """The rule of `cfg.optimizer` (one of REGIME_METHODS) over canonical `blocks` (trainer.zo.probes.Block) with
    param `groups`: the table normalised by `o.norm`; for zocurv-trust the region starting at it (o.start "table")
    or at 1, probing `source` (default: held_out_source(cfg)). Raises ValueError for another optimizer or a model
    trainer.zo.groups cannot assign, TypeError for non-fp32 weights."""
    if cfg.optimizer not in REGIME_METHODS:
        raise ValueError(f"{cfg.optimizer!r} is not one of {REGIME_METHODS}")
    gmap = assign_roles([(b.name, b.param) for b in blocks])
    params = [b.param for b in blocks]
    table = table_multipliers(gmap, norm=o.norm)
    common = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "blocks": params, "gmap": gmap}
    if cfg.optimizer == "zocurv-static":
        return BlockTableAdamW(groups, mult=table, **common)
    rule = TrustRegionRule(beta=o.beta, z_min=o.z_min, agree=o.agree, r_min=o.r_min, r_max=o.r_max, m_min=o.m_min,
                           m_max=o.m_max)
    start = table if o.start == "table" else {r: 1.0 for r in gmap.roles}
    trust = TrustRounds(rule, o.batches, cfg.curvature_interval, cfg.warmup_steps, source or held_out_source(cfg))
    return TrustRegionAdamW(groups, mult=start, trust=trust, **common)
