"""A run's health: every way a run degrades, said where the user looks.

`Health` collects warnings of a few fixed kinds (`KINDS`) while a run trains; each kind is said once on the
console when it first happens (logger "sparecycles.health", WARNING), counted in the Prometheus counter
`sparecycles_trainer_warnings_total{run, kind}` on every occurrence, and listed in summary.json by `trainer.train`:
`warnings` (one line per kind: kind, count, first detail and step, last detail) and `warning_counts` ({kind: n}).

Anyone in the process reports through the module function `warn(kind, detail, step=None)`: it goes to the
collector of the run training now (`trainer.train` activates one per run) and is only logged when none is
active (a helper used outside a run). The fleet side calls it for lost workers (fleet.attach.FleetFiguresMode) and
evaluations the trainer took over (fleet.evaluation.FleetEvaluator); the teacher side for missing targets
(kind "teacher_missing"). `Health.finish(records)` adds what only the whole run shows (rounds dropped, no round
ever applied, with the share of refreshes that had data) from the step records.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("sparecycles.health")

# The ways a run degrades. workers_lost: the coordinator's active workers fell below the most seen this run;
# rounds_dropped: probe rounds gone stale before they completed (skipped); rounds_never_applied: a fleet-probed
# ZO-Curv run in which no round ever folded (it equals AdamW); eval_fallback: a fleet evaluation the trainer
# finished itself (no worker answered within --eval-deadline); teacher_missing: distillation targets that did not
# come (the step trained on cross-entropy alone).
KINDS = ("workers_lost", "rounds_dropped", "rounds_never_applied", "eval_fallback", "teacher_missing")

WARNINGS = Counter("sparecycles_trainer_warnings", "Times a run degraded, by kind (trainer.health.KINDS): workers "
                   "lost, probe rounds dropped or never applied, evaluations the trainer took over from the fleet, "
                   "teacher targets missing.", ["run", "kind"])


@dataclass
class Warning_:
    """One kind's warnings of a run: how many, the first and last detail, the step of the first (None: not known)."""

    kind: str
    count: int
    first: str
    last: str
    first_step: int | None

    def line(self) -> str:
        """One line: "<kind> x<count>: <first detail>" (and the last detail when it differs)."""
        at = f" (first at step {self.first_step})" if self.first_step is not None else ""
        return (f"{self.kind} x{self.count}: {self.first}{at}"
                + (f"; last: {self.last}" if self.last != self.first else ""))


class Health:
    """The warnings of one run (module docstring). `run`: the Prometheus label (trainer.metrics' run label, the
    optimizer's name). Not thread-safe beyond the GIL's guarantees for one dict update (warnings are rare)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.by_kind: dict[str, Warning_] = {}
        self.fleet_probes = False  # set by a fleet-probed mode (fleet.attach.FleetFiguresMode)

    def warn(self, kind: str, detail: str, step: int | None = None, count: int = 1) -> None:
        """Record `count` occurrences of `kind` (one of KINDS) with a one-line `detail`; the first of a kind is
        logged at once. Raises ValueError for an unknown kind or a count below 1."""
        if kind not in KINDS:
            raise ValueError(f"unknown health warning kind {kind!r}; one of {', '.join(KINDS)}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        WARNINGS.labels(self.run, kind).inc(count)
        w = self.by_kind.get(kind)
        if w is None:
            self.by_kind[kind] = Warning_(kind, count, detail, detail, step)
            log.warning("%s", detail)
            return
        w.count += count
        w.last = detail

    def finish(self, records: list[dict[str, Any]]) -> None:
        """Add the whole run's round warnings from its step records (the round book's cumulative counters,
        trainer.zo.rounds.RoundBook.stats): `rounds_dropped` when any round was dropped, `rounds_never_applied`
        when the run was fleet-probed and no round ever folded although refreshes issued some."""
        last = _last_round_counters(records)
        if not last:
            return
        dropped, folded = last.get("dropped_rounds", 0.0), last.get("folded_rounds", 0.0)
        refreshes, with_data = last.get("refreshes", 0.0), last.get("refreshes_with_data", 0.0)
        share = f"{with_data:.0f} of {refreshes:.0f} refreshes had data" if refreshes else "no refresh had data"
        if dropped > 0:
            self.warn("rounds_dropped", f"{dropped:.0f} probe round(s) dropped: stale before they completed "
                      f"({share}; pending at the end: {last.get('pending_rounds', 0.0):.0f})", count=int(dropped))
        if self.fleet_probes and folded == 0 and refreshes > 0:
            self.warn("rounds_never_applied", f"no probe round was ever applied ({share}): every curvature "
                      "multiplier stayed 1.0, so this run equals AdamW")

    def never_applied(self) -> str | None:
        """The one-line "no round ever applied" detail when that happened, else None."""
        w = self.by_kind.get("rounds_never_applied")
        return w.first if w else None

    def lines(self) -> list[str]:
        """summary.json's `warnings` (and the console's end-of-run lines): `Warning_.line` per kind, KINDS order."""
        return [self.by_kind[k].line() for k in KINDS if k in self.by_kind]

    def counts(self) -> dict[str, int]:
        """summary.json's `warning_counts`: {kind: occurrences} (the Prometheus counter's values for this run)."""
        return {k: self.by_kind[k].count for k in KINDS if k in self.by_kind}


def _last_round_counters(records: list[dict[str, Any]]) -> dict[str, float]:
    """The newest `<prefix>_<counter>` values of the round book (any prefix) in `records`, without the prefix."""
    names = ("dropped_rounds", "pending_rounds", "folded_rounds", "refreshes_with_data", "refreshes")
    out: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            for n in names:
                if k.endswith(f"_{n}"):
                    out[n] = float(v)
                    break
    return out


_CURRENT: contextvars.ContextVar[Health | None] = contextvars.ContextVar("sparecycles_health", default=None)
_ACTIVE: list[Health] = []  # the same, for threads that do not inherit the context (background uploads)


@contextlib.contextmanager
def activate(health: Health) -> Iterator[Health]:
    """Make `health` the collector `warn` reports to while the block runs (trainer.train: one per run)."""
    token = _CURRENT.set(health)
    _ACTIVE.append(health)
    try:
        yield health
    finally:
        _CURRENT.reset(token)
        _ACTIVE.remove(health)


def current() -> Health | None:
    """The collector of the run training now, or None."""
    return _CURRENT.get() or (_ACTIVE[-1] if _ACTIVE else None)


def warn(kind: str, detail: str, step: int | None = None, count: int = 1) -> None:
    """THE HOOK: report that the run degraded (`kind` one of KINDS, `detail` one line for a user). Goes to the
    active run's collector (console once per kind, metric, summary.json); logged only when no run is active.
    Raises ValueError for an unknown kind."""
    h = current()
    if h is None:
        if kind not in KINDS:
            raise ValueError(f"unknown health warning kind {kind!r}; one of {', '.join(KINDS)}")
        log.warning("%s", detail)
        return
    h.warn(kind, detail, step=step, count=count)
