"""Held-out evaluation on the fleet (`--eval-on fleet`): the trainer publishes the version and moves on.

`FleetEvaluator` is a trainer.evaluation.Evaluator. At an evaluation step it copies the weights to the host,
publishes them as that step's version on a coordinator run of its own (`<prefix>-eval-<hex>`, staleness bound
out of reach: an old version's evaluation never goes stale) and opens one `eval` round over the run's held-out
windows (wire.messages.EvalSpec: the windows travel once as a batch blob; seed k = batch k). Every
`poll` (rate-limited: `poll_s`) takes what the workers sent; a completed round becomes the record of its step
(`eval_on: "fleet"`). A round that gets no result for `deadline_s` seconds is finished by the trainer: it
evaluates the missing batches itself on the version's host copy (a scratch model) and the record says so
(`eval_on: "trainer"`, `eval_trainer_batches`). Either way the values come from
trainer.evaluation.batch_values and combine in batch order, so a record is the same bit for bit whoever
evaluated which batch. `finish` waits for (or evaluates) everything outstanding: the final evaluation is
complete before the run reports. A coordinator that loses the run (its store came back empty) gets it again: the
pending versions are published again from their host copies and their rounds re-issued, the batches already in
kept (fleet.recovery; never dropped).

Default windows: the trainer's own subset (`--eval-batches`), as `--eval-on trainer` scores, so both places score
the same windows by default and a tiny run's evaluation takes seconds; `full=True` (`--eval-windows full`) scores
the whole validation split. Intake deduplicates by (round, batch), so a batch evaluated
twice (a redelivered task, a re-issued one after a worker died) counts once.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fleet.anytime import FleetScorer
from trainer import health as run_health
from trainer.console import STOP_REQUESTED
from trainer.evaluation import EvalWindows, batch_values, combine, lm_windows
from trainer.models.causal_lm import model_label
from trainer.zo.probes import canonical_blocks
from wire import batch as batch_wire
from wire.bounds import MAX_STALENESS  # an eval run's results never go stale: every version's score is wanted
from wire.messages import RunSpec, share_fields
from wire.round_messages import EvalSpec, ProbeRound, WeightTerm

log = logging.getLogger("sparecycles.fleet")


@dataclass
class _Pending:
    """One evaluation in flight: its round, host weights, batch values so far and when it last progressed."""

    round_id: str
    weights: list[torch.Tensor]
    t_request: float
    t_progress: float
    values: dict[int, tuple[float, float]] = field(default_factory=dict)


class FleetEvaluator:
    """trainer.evaluation.Evaluator whose evaluations run on a coordinator's probe workers.

    Args:
        task: the run's Task (its `eval_windows(full)` are scored). cfg: the run's TrainConfig. model: the trained
            module (its weights at `request` are what is evaluated).
        fleet: a fleet.attach.Fleet (coordinator URL, credentials, worker count).
        deadline_s: seconds without any result for a round after which the trainer evaluates its missing batches.
        full: the whole validation split instead of the run's `eval_batches` subset (default).
        poll_s: at most one look at the result stream per this many seconds while evaluations are pending.
        seeds_per_task: evaluation batches per Celery task (default: about four tasks per worker, at most 64
            batches each: a task's fixed cost, a Celery delivery and an HTTP post, dwarfs a tiny batch's forward, and
            a task posts its results at once, so it must stay well inside `deadline_s`).
    Raises CoordinatorHTTPError when the coordinator refuses the run; ValueError for a model it cannot publish.
    """

    def __init__(self, task: Any, cfg: Any, model: torch.nn.Module, fleet: Any, *, deadline_s: float = 120.0,
                 full: bool = False, poll_s: float = 0.25, seeds_per_task: int | None = None,
                 clock=time.monotonic) -> None:
        lm = getattr(cfg, "task", "lm") != "sentiment"
        self.device, self.deadline_s, self.poll_s, self.clock = cfg.device, deadline_s, poll_s, clock
        self._set_up(task.eval_windows(full), model, fleet, model_preset=model_label(cfg.model) if lm else None,
                     seeds_per_task=seeds_per_task,
                     select={"batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "split": f"{cfg.corpus}/select"})

    @classmethod
    def on_windows(cls, windows: EvalWindows, model: torch.nn.Module, fleet: Any, *, device: str = "cpu",
                   deadline_s: float = 120.0, poll_s: float = 0.25, seeds_per_task: int | None = None,
                   clock=time.monotonic) -> FleetEvaluator:
        """A FleetEvaluator of any loop (sparecycles.loop): `windows` (trainer.evaluation.EvalWindows, e.g.
        `lm_windows`) scored on the fleet at each `request`; fallbacks run on `device`. Raises as the class does."""
        self = cls.__new__(cls)
        self.device, self.deadline_s, self.poll_s, self.clock = device, deadline_s, poll_s, clock
        self._set_up(windows, model, fleet, model_preset=None, seeds_per_task=seeds_per_task, select=None)
        return self

    def _set_up(self, windows: EvalWindows, model: torch.nn.Module, fleet: Any, *, model_preset: str | None,
                seeds_per_task: int | None, select: dict[str, Any] | None) -> None:
        """The one constructor body (the run's windows, or any loop's: `on_windows`), after the constructor set
        where and when fallbacks run (device, deadline_s, poll_s, clock)."""
        from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress

        self.model, self.model_preset, self.select = model, model_preset, select
        self.windows: EvalWindows = windows
        self.kind = batch_wire.batch_kind_for_model(type(model).__name__)
        if self.kind != self.windows.kind:
            raise ValueError(f"the model's batches are {self.kind!r}, the windows {self.windows.kind!r}")
        self.blob = batch_wire.encode_batch(self.windows.tensors, self.kind)
        import hashlib

        self.blob_sha = hashlib.sha256(self.blob).hexdigest()
        if seeds_per_task is None:
            seeds_per_task = min(64, max(1, -(-self.windows.n_batches // (4 * max(1, fleet.workers)))))
        spec = RunSpec(run=f"{fleet.run_prefix}-eval-{secrets.token_hex(4)}", model_class=type(model).__name__,
                       model_preset=model_preset, staleness=MAX_STALENESS, seeds_per_task=seeds_per_task,
                       **share_fields(fleet.share),
                       **({"spot_check_fraction": 0.0} if fleet.workers < 2 else {}))
        backend = CoordinatorBackend.connect(model, spec, FleetAddress.of(fleet.base, fleet.settings),
                                             BackendTuning.publishing(fleet.settings.blob_dir))
        # Outlives a coordinator whose store comes back empty: the run is created again, the pending versions
        # published again and their rounds re-issued (fleet.recovery).
        self.backend = backend.recoverable(spec, republish=self._republish)
        self.run, self.fleet, self.scorer = spec.run, fleet, None
        self.pending: dict[int, _Pending] = {}
        self._rounds: dict[str, int] = {}  # round id -> step
        self._last_poll = float("-inf")
        self._scratch: torch.nn.Module | None = None

    # ---- trainer.evaluation.Evaluator ------------------------------------------------------------

    def request(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        """Publish the current weights as version `step`, open its eval round and return at once (records of
        earlier steps that are ready come back)."""
        blocks = canonical_blocks(model)
        weights = [b.param.detach().to("cpu", copy=True) for b in blocks]  # the upload's and the fallback's copy
        rid = f"eval-{step}"
        now = self.clock()
        self.pending[step] = _Pending(rid, weights, now, now)  # pending first: a recovery re-publishes it too
        self._rounds[rid] = step
        self.backend.publish(step, weights=weights)
        wire = ProbeRound(schema_version=3, run=self.run, round_id=rid, version=step, batch_sha256=self.blob_sha,
                          eps=1.0, distribution="rademacher", seeds=list(range(self.windows.n_batches)), kind="eval",
                          eval=EvalSpec(split=self.windows.split, batch_size=self.windows.batch_size,
                                        weights=[WeightTerm(version=step, coeff=1.0)]))
        self.backend.submit_wire(wire, self.blob)
        return self.poll()

    def poll(self) -> list[dict[str, Any]]:
        """Records of the evaluations completed (or past their deadline, then finished here), in step order."""
        if not self.pending or self.clock() - self._last_poll < self.poll_s:
            return []
        return self._take(force=False)

    def finish(self) -> list[dict[str, Any]]:
        """Every outstanding evaluation's record, waiting for the fleet up to each one's deadline; once the run is
        stopping (trainer.console.STOP_REQUESTED: the first Ctrl-C or SIGTERM) without waiting: the trainer evaluates
        the missing batches itself, so the records are complete and the stop is not held for `deadline_s`."""
        out: list[dict[str, Any]] = []
        while self.pending:
            out += self._take(force=STOP_REQUESTED.is_set())
            if self.pending:
                time.sleep(min(0.05, self.poll_s))
        return out

    def close(self, wait: bool = True) -> None:
        """Close the backend (its uploads: finished when `wait`, else cancelled; the eval run's rounds cancelled on the
        coordinator), and the anytime scorer's."""
        self.backend.close(wait=wait, end=True)
        if self.scorer is not None:
            self.scorer.close(wait=wait)

    def anytime_scorer(self, anytime: Any) -> Any:
        """A fleet.anytime.FleetScorer for `anytime` (trainer.anytime.serve.Anytime): its candidates scored on this
        fleet over the selection split (closed with this evaluator). Raises ValueError with `pull` (a pull rewrites
        a version the coordinator already holds) or a ring larger than an eval round's mixture."""
        if anytime.settings.pull:
            raise ValueError("--pull is in-process only: a pull republishes a version the fleet already holds")
        select = self.select or {"batch_size": anytime.batch_size, "seq_len": anytime.seq_len, "split": "select"}
        windows = lm_windows(anytime.select_tokens, select["batch_size"], select["seq_len"],
                             anytime.settings.select_batches, split=select["split"])
        self.scorer = FleetScorer(anytime.ring, self.model, windows, fleet=self.fleet, model_preset=self.model_preset,
                                  deadline_s=self.deadline_s, device=self.device)
        return self.scorer

    # ---- internals ------------------------------------------------------------------------------

    def _take(self, force: bool) -> list[dict[str, Any]]:
        self._last_poll = now = self.clock()
        got = self.backend.collect()
        for r in got.results:
            step = self._rounds.get(r.round_id)
            if step is not None and step in self.pending:
                p = self.pending[step]
                p.values.setdefault(int(r.seed), (r.l_plus, r.l_minus))
                p.t_progress = now
        out = []
        for step in sorted(self.pending):
            p = self.pending[step]
            if len(p.values) == self.windows.n_batches:
                out.append(self._record(step, p, trainer_batches=0))
            elif force or now - p.t_progress >= self.deadline_s:
                missing = [k for k in range(self.windows.n_batches) if k not in p.values]
                log.warning("evaluation of step %d: %d of %d batches not in after %.0f s without progress; "
                            "evaluating them on the trainer", step, len(missing), self.windows.n_batches,
                            now - p.t_progress)
                run_health.warn("eval_fallback", f"evaluation of step {step}: {len(missing)} of "
                                f"{self.windows.n_batches} batches not in from the fleet after {now - p.t_progress:.0f} s "
                                "(--eval-deadline); evaluated on the trainer", step=step)
                self.backend.withdraw(p.round_id)  # taken over: no worker keeps scoring it
                p.values.update(self._evaluate_here(p.weights, missing))
                out.append(self._record(step, p, trainer_batches=len(missing)))
            else:
                continue
            del self.pending[step], self._rounds[p.round_id]
            self.backend.forget(p.round_id)
        return out

    def _republish(self, publisher: Any) -> None:
        """fleet.recovery's `republish`: the coordinator lost this run; publish every pending evaluation's version
        again from its host copy (their rounds are re-issued after), and restart their deadlines."""
        now = self.clock()
        for step in sorted(self.pending):
            p = self.pending[step]
            publisher.publish(step, weights=p.weights)
            p.t_progress = now

    def _record(self, step: int, p: _Pending, trainer_batches: int) -> dict[str, Any]:
        n = self.windows.n_batches
        values = [p.values[k] for k in range(n)]
        return {"step": step, **combine(self.windows.kind, values, self.windows.rows),
                "eval_on": "trainer" if trainer_batches else "fleet", "eval_fleet_batches": n - trainer_batches,
                "eval_trainer_batches": trainer_batches, "eval_latency_s": self.clock() - p.t_request}

    def _evaluate_here(self, weights: list[torch.Tensor], batches: list[int]) -> dict[int, tuple[float, float]]:
        """batch_values of `batches` at the version whose host copy is `weights`, on a scratch copy of the model."""
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model)
        with torch.no_grad():
            for b, w in zip(canonical_blocks(self._scratch), weights, strict=True):
                b.param.copy_(w)
        dev = self.device
        return {k: batch_values(self._scratch, self.windows.kind, self.windows.batch(k, dev)) for k in batches}
