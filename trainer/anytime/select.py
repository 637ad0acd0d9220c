"""Choosing the served candidate: score the named candidates, fit the quadratic, keep the best measured one.

`select_candidate` is a pure function of the number of versions held, the settings and a `score` callback
(the trainer's in-process evaluator or the fleet's), so the same choice runs in tests, in process and on a
fleet. Every loss here is measured on the *selection* split, never on the reported validation split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from trainer.anytime.candidates import named_candidates
from trainer.anytime.quadratic import (
    DTYPE,
    QuadraticFit,
    coefs_at,
    fit_quadratic,
    minimise_on_simplex,
    simplex_lattice,
)
from trainer.anytime.settings import AnytimeSettings

# score([(name, coefs), ...]) -> one (B,) float64 tensor of per-batch selection losses per candidate
Score = Callable[[Sequence[tuple[str, tuple[float, ...]]]], list[torch.Tensor]]


@dataclass(frozen=True)
class Scored:
    """One measured candidate: its coefficients over the versions held (oldest first) and per-batch losses."""

    name: str
    coefs: tuple[float, ...]
    losses: torch.Tensor  # (B,) float64, nats/token, one per selection batch

    @property
    def mean(self) -> float:
        return float(self.losses.mean())


@dataclass(frozen=True)
class Selection:
    """The outcome of one selection: `winner` (lowest mean selection loss) among everything `scored`.

    `fit` is the quadratic (None when not attempted); `quad_pred`/`quad_meas` the fit minimiser's predicted and
    measured selection loss (None when the fit was refused or not attempted); `anchors` the names spanning
    the fit's simplex.
    """

    winner: Scored
    raw: Scored
    scored: list[Scored]
    fit: QuadraticFit | None = None
    quad_pred: float | None = None
    quad_meas: float | None = None
    anchors: tuple[str, ...] = field(default=())

    def paired_z(self) -> float:
        """How many standard errors the winner beats raw by on the selection batches (paired differences:
        z = -mean(d) / (std(d) / sqrt(B)), d = winner - raw per batch). 0 when the winner is raw; +inf when
        every batch improves by the same amount."""
        d = self.winner.losses - self.raw.losses
        if self.winner.name == "raw" or d.numel() < 2:
            return 0.0
        se = float(d.std()) / math.sqrt(d.numel())
        return math.inf if se == 0 and float(d.mean()) < 0 else (-float(d.mean()) / se if se > 0 else 0.0)


def select_candidate(k_held: int, settings: AnytimeSettings, score: Score) -> Selection:
    """Score the named candidates over `k_held` versions, then (settings.quad_dim > 0 and enough distinct
    candidates) fit the quadratic on a simplex lattice spanned by raw and the best `quad_dim` named
    candidates, measure its minimiser, and return the best measured candidate.

    Raises:
        ValueError: k_held < 1, or `score` returned the wrong number of results.
    """
    if k_held < 1:
        raise ValueError("no versions held yet")
    score = _Memo(score)
    named = named_candidates(k_held, settings.half_lives, settings.windows)
    scored = _score(score, list(named.items()))
    raw = scored[0]
    fit = quad_pred = quad_meas = None
    anchors: tuple[str, ...] = ()
    distinct = _distinct(scored)
    d = min(settings.quad_dim, len(distinct) - 1)
    if d >= 1:
        others = sorted((s for s in distinct if s.name != "raw"), key=lambda s: s.mean)[:d]
        picks = [raw, *others]
        anchors = tuple(s.name for s in picks)
        a = torch.tensor([s.coefs for s in picks], dtype=DTYPE)  # (d+1, k)
        u = simplex_lattice(d, settings.quad_n)
        todo = [(f"lat{i}", _tuple(coefs_at(row, a))) for i, row in enumerate(u) if float(row.max()) < 1.0]
        lat = iter(_score(score, todo))
        means, lat_scored = [], []
        for row in u:
            if float(row.max()) == 1.0:
                means.append(picks[int(torch.argmax(row))].mean)
            else:
                s = next(lat)
                lat_scored.append(s)
                means.append(s.mean)
        fit = fit_quadratic(u, torch.tensor(means, dtype=DTYPE), rel_tol=settings.quad_rel_tol)
        scored += lat_scored
        if fit.ok:
            u_star, quad_pred = minimise_on_simplex(fit)
            (best,) = _score(score, [("quad", _tuple(coefs_at(u_star, a)))])
            quad_meas = best.mean
            scored.append(best)
    winner = min(scored, key=lambda s: (s.mean, s.name != "raw"))  # ties go to raw
    return Selection(winner, raw, scored, fit, quad_pred, quad_meas, anchors)


class _Memo:
    """A Score that measures each distinct coefficient vector once per selection (with few versions held, EMAs
    and window averages coincide; the fit's vertices are the anchors already scored)."""

    def __init__(self, score: Score) -> None:
        self.score, self.seen = score, {}

    def __call__(self, cands: Sequence[tuple[str, tuple[float, ...]]]) -> list[torch.Tensor]:
        key = [tuple(round(c, 12) for c in coefs) for _, coefs in cands]
        todo = {k: c for k, c in zip(key, cands, strict=True) if k not in self.seen}
        if todo:
            got = self.score(list(todo.values()))
            if len(got) != len(todo):
                raise ValueError(f"score returned {len(got)} results for {len(todo)} candidates")
            self.seen.update(zip(todo, got, strict=True))
        return [self.seen[k] for k in key]


def _score(score: Score, cands: list[tuple[str, tuple[float, ...]]]) -> list[Scored]:
    if not cands:
        return []
    got = score(cands)
    if len(got) != len(cands):
        raise ValueError(f"score returned {len(got)} results for {len(cands)} candidates")
    return [Scored(n, c, torch.as_tensor(v, dtype=DTYPE).reshape(-1)) for (n, c), v in zip(cands, got, strict=True)]


def _distinct(scored: list[Scored]) -> list[Scored]:
    """Candidates with distinct coefficient vectors (e.g. avg8 == ema-inf, or windows clipped to k)."""
    seen: list[tuple[float, ...]] = []
    out = []
    for s in scored:
        if all(max(abs(x - y) for x, y in zip(s.coefs, t, strict=True)) > 1e-12 for t in seen):
            seen.append(s.coefs)
            out.append(s)
    return out


def _tuple(c: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(x) for x in c)
