"""Probe evaluation of one worker, independent of Celery: task kwargs in, posted results out.

One `ProbeRuntime` per worker process. For a task it validates the kwargs as a `ProbeTask`, attests the
run's canary once, loads the version through the `WeightCache`, fetches the round's batch once by
content hash, computes L0 once per (run, version, batch) and L(theta +- eps z(seed)) per seed with the
probe kind's rule in trainer.zo.probes (the same code the trainer's in-process backend runs), and posts
the task's results in one `ResultBatch`. Every loss of a task, L0 included, runs through one evaluator
that `probe_kernels.make_evaluator` picks from free memory and logs (a whole-model scratch copy with a compiled
forward on CUDA, else per-unit hooks), so L+ + L- - 2 L0 compares like with like. The loss and the batch format follow from the version manifest's
model class (wire.batch): causal LMs take `lm/1` batches and trainer.models.losses.lm_loss, sequence
classifiers `classifier/1` batches and trainer.sentiment.classifier_loss; a batch that is malformed, of the
other kind, or outside the model's vocabulary/positions/labels raises BatchFormatError before any forward
pass. Evaluation is a pure function of (weights, batch, seed, eps, distribution), so re-running a
redelivered task re-posts identical values, which the coordinator deduplicates by (round, seed).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.client import CoordinatorClient
from probe_kernels import FastForward, make_evaluator
from probe_kernels.fastpath import MODES
from probe_worker.cache import WeightCache
from probe_worker.metrics import WorkerMetrics, default_metrics
from probe_worker.task_checks import canary_digest
from trainer.anytime.ring import build_mixture
from trainer.batch_losses import loss_for_kind
from trainer.evaluation import batch_of, batch_values
from trainer.models.losses import lm_batch_loss
from trainer.zo import probes
from wire.batch import BatchFormatError, batch_kind_for_model, check_fits, decode_batch
from wire.bounds import MAX_TASK_S
from wire.messages import Attestation
from wire.round_messages import IntakeReply, ProbeResult, ProbeTask, ResultBatch, non_finite_result

log = logging.getLogger("sparecycles.worker")
# Intake outcomes that keep a posted value as this worker's (what intake's `same_worker` rule checks).
KEPT_AS_MINE = frozenset({"held", "accepted"})


@dataclass(frozen=True)
class ForwardSettings:
    """How a worker's probe and eval forwards run.

    probe_path: "auto" (whole-model copy when it fits in free memory, else per-unit), "whole" or "per_unit"
    (probe_kernels.fastpath.make_evaluator); compile: torch.compile the whole-model forward (None: on CUDA);
    cuda_graphs: replay it as CUDA graphs; attn_dtype: the attention dtype of the perturbing kinds' fp32 forwards
    (None: theirs; bf16: probe_kernels.FastForward's attn_dtype); segmented: compile the forwards block by block, so
    a task can stop between blocks (beside an engine). Raises ValueError for an unknown probe_path.
    """

    probe_path: str = "auto"
    compile: bool | None = None
    cuda_graphs: bool = False
    attn_dtype: torch.dtype | None = None
    segmented: bool = False

    def __post_init__(self) -> None:
        if self.probe_path not in MODES:
            raise ValueError(f"probe_path must be one of {MODES}, got {self.probe_path!r}")


class ProbeRuntime:
    """Evaluates probe tasks for worker `worker_id` on `cache.device`; thread-safe for one task at a time
    (`_lock`, the evaluation lock), with `prefetch` loading snapshot versions beside a running task.

    Args:
        client: authenticated (worker token) coordinator client.
        worker_id: this worker's id (stamped on every result).
        cache: the weight cache (decides the device).
        metrics: counters and histograms (default: the process-wide set).
        keep_rounds: clean losses remembered (per (run, version, batch hash)).
        forwards: how the probe and eval forwards run (ForwardSettings; default: its defaults).
    """

    def __init__(self, client: CoordinatorClient, worker_id: str, cache: WeightCache,
                 metrics: WorkerMetrics | None = None, keep_rounds: int = 64,
                 forwards: ForwardSettings | None = None) -> None:
        self.client, self.worker_id, self.cache = client, worker_id, cache
        self.metrics = metrics or default_metrics()
        self.keep_rounds = keep_rounds
        f = forwards or ForwardSettings()
        self.probe_path, self.compile, self.cuda_graphs = f.probe_path, f.compile, f.cuda_graphs
        self.attn_dtype, self.segmented = f.attn_dtype, f.segmented
        self._clean: OrderedDict[tuple[str, int, str], float] = OrderedDict()
        self._batches: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._attested: set[str] = set()
        # (run, round, seed) -> replicas this worker posted; (run, round, seed, replica) -> hand-backs
        self._posted: OrderedDict[tuple[str, str, int], set[int]] = OrderedDict()
        self._handed_back: OrderedDict[tuple[str, str, int, int], int] = OrderedDict()
        self._evaluators: dict[torch.dtype, Any] = {}  # weight dtype -> probe evaluator
        self._cast_of: tuple[int, torch.nn.Module, torch.nn.Module] | None = None  # (id, model, its bf16 copy)
        self._lock = threading.Lock()
        self.tasks_done = 0
        self.busy = False
        self.current_version: int | None = None
        self._mix_scratch: torch.nn.Module | None = None  # where weight mixtures of eval rounds are built
        self._ff: Any = None  # the bf16 compiled forward of eval rounds (probe_kernels.FastForward), and what it holds
        self._ff_holds: tuple | None = None
        self._closed: OrderedDict[tuple[str, str], None] = OrderedDict()  # rounds seen closed (final)
        self._open_at: dict[tuple[str, str], float] = {}  # round -> when it was last seen open (monotonic s)

    # ---- cached inputs ------------------------------------------------------------------------------

    def _batch(self, sha256: str, kind: str) -> Any:
        """The decoded batch blob `sha256` of `kind` on the cache's device (BatchFormatError if malformed)."""
        key = (sha256, kind)
        if key in self._batches:
            self.metrics.cache_hits.labels("batch").inc()
            self._batches.move_to_end(key)
            return self._batches[key]
        self.metrics.cache_misses.labels("batch").inc()
        tensors = decode_batch(self.client.get_blob(sha256), kind)  # type: ignore[arg-type]
        if torch.device(self.cache.device).type == "cuda":  # pinned: the copy is a DMA that overlaps queued work
            batch = tuple(t.pin_memory().to(self.cache.device, non_blocking=True) for t in tensors)
        else:
            batch = tuple(t.to(self.cache.device) for t in tensors)
        self._batches[key] = batch
        while len(self._batches) > 4:
            self._batches.popitem(last=False)
        return batch

    def _evaluator(self, model: torch.nn.Module, loss_fn):
        """The probe evaluator of `model` (probe_kernels.make_evaluator): one per weight dtype (a worker serving fp32 and
        bf16 kinds keeps both copies); a new version of the same architecture rebinds it (compiled code kept)."""
        slot = next(model.parameters()).dtype
        ev = self._evaluators.get(slot)
        if ev is not None and ev.model is model and ev.loss_fn is loss_fn:
            return ev
        if ev is not None and ev.loss_fn is loss_fn and hasattr(ev, "rebind") and ev.rebind(model):
            return ev  # a new version: keep the copy and its compiled forward
        if ev is not None:
            ev.close()
            del self._evaluators[slot]  # the old scratch copy is freed before the new one is sized
        ev = self._evaluators[slot] = make_evaluator(model, loss_fn, self.probe_path, self.compile, self.cuda_graphs,
                                                     attn_dtype=self.attn_dtype if slot == torch.float32 else None,
                                                     segmented=self.segmented)
        return ev

    @torch.no_grad()
    def _cast(self, model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
        """`model` itself (dtype None or its own), else a copy of it in `dtype` (one kept: the latest version's)."""
        if dtype is None or next(model.parameters()).dtype == dtype:
            return model
        if self._cast_of is not None and self._cast_of[0] == id(model) and self._cast_of[1] is model:
            return self._cast_of[2]
        import copy

        self._cast_of = None  # the previous copy is freed first
        cast = copy.deepcopy(model).to(dtype).eval()
        self._cast_of = (id(model), model, cast)
        return cast

    def _attest(self, run: str) -> None:
        if run in self._attested:
            return
        canary = self.client.run_info(run).spec.canary
        if canary is not None:
            digest = canary_digest(canary.seed, canary.numel, canary.distribution)
            self.client.attest(run, Attestation(worker_id=self.worker_id, digest=digest))
        self._attested.add(run)

    def _timed_loss(self, ev, batch: Any, seed: int | None, alpha: float, dist: str) -> float:
        t0 = time.perf_counter()
        value = ev.loss(batch, seed, alpha, dist) if seed is not None else ev.clean_loss(batch)
        self.metrics.eval_seconds.observe(time.perf_counter() - t0)
        return value

    def _seeded_all(self, task: ProbeTask, ev, batch: Any) -> dict[tuple[int, float, str], float]:
        """A seeded task's L(theta +- eps z(s)) for all its seeds in one pipelined pass (`ev.losses`: one wait
        for the whole task, same bits as one call per loss), keyed (seed, +-eps, distribution)."""
        t0 = time.perf_counter()
        pairs = ev.losses(batch, task.seeds, task.eps, task.distribution)
        per = (time.perf_counter() - t0) / max(1, 2 * len(task.seeds))
        out = {}
        for s, (lp, lm) in zip(task.seeds, pairs):
            out[(s, float(task.eps), str(task.distribution))] = lp
            out[(s, -float(task.eps), str(task.distribution))] = lm
            self.metrics.eval_seconds.observe(per)
            self.metrics.eval_seconds.observe(per)
        return out

    def _site(self, task: ProbeTask, model: torch.nn.Module, ev, batch: Any,
              done: dict[tuple[int, float, str], float] | None = None,
              loaded: torch.nn.Module | None = None) -> probes.ProbeSite:
        """Where the task's probes run (trainer.zo.probes gives every kind its meaning): the loaded version's
        blocks, timed losses (seeded ones from `done` when there), and for along_update, line and group_line rounds
        u_b = theta_v[b] - theta_base[b] in fp32, from the loaded versions (`loaded`: theta_v as loaded, when `model` is
        its copy in the kind's forward dtype)."""
        blocks = probes.canonical_blocks(model)
        exact = probes.canonical_blocks(loaded) if loaded is not None and loaded is not model else blocks

        def loss(new: Mapping[int, torch.Tensor] | None) -> float:
            # through the evaluator's own forward (the one L0 and the seeded probes take)
            t0 = time.perf_counter()
            value = ev.loss_swapped(batch, new)
            self.metrics.eval_seconds.observe(time.perf_counter() - t0)
            return value

        update = None
        if probes.KINDS[probes.ProbeKind(task.kind)].needs_base:  # along_update, line, group_line
            base = probes.canonical_blocks(self.cache.get(task.run, task.base_version).model)
            if len(base) != len(blocks):
                raise ValueError(f"versions {task.base_version} and {task.version} differ in blocks")

            def update(b: int) -> torch.Tensor:
                return exact[b].param.detach().float() - base[b].param.detach().float()
        done = done or {}

        def seeded(s: int, a: float, d: str) -> float:
            hit = done.get((s, a, d))
            return hit if hit is not None else self._timed_loss(ev, batch, s, a, d)

        return probes.ProbeSite(blocks, loss, seeded, update)

    # ---- one task -----------------------------------------------------------------------------------

    def evaluate(self, task: ProbeTask) -> list[ProbeResult]:
        """Evaluate a task's seeds; returns one ProbeResult per seed, in the task's seed order.

        l0 is set (for every result) when the task wants the clean loss. Raises the cache's and the
        client's errors (unknown version, corrupt shards, coordinator unreachable), BatchFormatError for a
        batch that is malformed or does not fit the version's model, ValueError for a model class without a
        probe loss.
        """

        with self._lock:
            self.busy = True
            try:
                self._attest(task.run)
                loaded = self.cache.get(task.run, task.version)
                self.current_version = task.version
                kind = batch_kind_for_model(loaded.manifest.model_class)
                batch = self._batch(task.batch_sha256, kind)
                check_fits(loaded.model, kind, batch)
                if task.kind == "eval":
                    return self._evaluate_batches(task, loaded.model, kind, batch)
                # the kind's forward precision (trainer.zo.probes.KINDS[kind].precision): bf16 kinds probe a bf16 copy
                dtype = probes.forward_dtype(task.kind, self.cache.device) if kind == "lm" else None
                model = self._cast(loaded.model, dtype)
                ev = self._evaluator(model, loss_for_kind(kind))
                l0 = None
                if task.want_clean:
                    key = (task.run, task.version, task.batch_sha256, str(dtype))  # rounds may share a batch
                    if key in self._clean:
                        self.metrics.cache_hits.labels("clean").inc()
                        l0 = self._clean[key]
                    else:
                        self.metrics.cache_misses.labels("clean").inc()
                        l0 = self._clean[key] = self._timed_loss(ev, batch, None, 0.0, task.distribution)
                        self.metrics.clean.inc()
                        while len(self._clean) > self.keep_rounds:
                            self._clean.popitem(last=False)
                if task.blocks is not None:  # ProbeFitError: the task is invalid for this model (probe_worker.tasks)
                    probes.check_fits(probes.canonical_blocks(loaded.model), task.blocks,
                                      [tuple(sl) for sl in task.slices or ()])
                done = self._seeded_all(task, ev, batch) if task.kind == "seeded" else None
                site = self._site(task, model, ev, batch, done, loaded.model)
                out = []
                for seed in task.seeds:
                    lp, lm, _ = probes.probe_losses(site, task.kind, seed, task.eps, task.distribution,
                                                    task.blocks or (), l0, [tuple(sl) for sl in task.slices or ()])
                    self.metrics.probes.inc()
                    fields = {
                        "run": task.run, "round_id": task.round_id, "seed": seed, "version": task.version,
                        "worker_id": self.worker_id, "replica": task.replica, "l_plus": lp, "l_minus": lm,
                        "l0": l0,
                    }
                    if all(math.isfinite(v) for v in (lp, lm, 0.0 if l0 is None else l0)):
                        out.append(ProbeResult(**fields))
                    else:  # reported as such: intake counts it `non_finite` and re-issues the seed
                        log.warning("round %s seed %d: non-finite loss", task.round_id, seed)
                        out.append(non_finite_result(**fields))
                return out
            finally:
                self.busy = False

    def _evaluate_batches(self, task: ProbeTask, model: torch.nn.Module, kind: str, batch: Any) -> list[ProbeResult]:
        """An eval task (wire.messages.EvalSpec): per seed k, batch k of the round's held-out windows scored by
        trainer.evaluation.batch_values, the trainer's own evaluation code (so the values equal the trainer's).
        A weight mixture θ = Σ coeff·θ_version (the anytime model's candidates) is built from this worker's cache by
        trainer.anytime.ring.build_mixture, the trainer's own code and summation order, into a scratch copy of the
        model, so it equals the trainer's in-process build bit for bit; versions not loaded are fetched (keep
        `--keep-versions` >= the ring's k to avoid refetching). Raises ValueError for a task without its spec or a
        mixture whose coefficients do not sum to 1, the cache's errors for a version it cannot get, and
        BatchFormatError for a batch index outside the windows."""

        spec = task.eval
        if spec is None:
            raise ValueError("an eval task needs its eval spec")
        terms = [(t.version, t.coeff) for t in spec.weights]
        if terms != [(task.version, 1.0)]:
            model = self._mixture(task.run, terms, model)
        try:
            rows = [batch_of(batch, spec.batch_size, k, self.cache.device) for k in task.seeds]
        except IndexError as exc:
            raise BatchFormatError(str(exc)) from None
        t0 = time.perf_counter()
        dtype = probes.forward_dtype(task.kind, self.cache.device) if kind == "lm" else None
        if dtype is not None:  # the fast path: every batch's forward queued, the values read once
            ff = self._fast_forward(model, (task.run, tuple(terms), id(model)), dtype)
            queued = [ff(r) for r in rows]
            values = [(v, 0.0) for v in torch.stack([q.float() for q in queued]).tolist()]
        else:
            values = [batch_values(model, kind, r) for r in rows]  # type: ignore[arg-type]
        per = (time.perf_counter() - t0) / max(1, len(rows))
        out = []
        for k, (value, aux) in zip(task.seeds, values):
            self.metrics.eval_seconds.observe(per)
            fields = {"run": task.run, "round_id": task.round_id, "seed": k, "version": task.version,
                      "worker_id": self.worker_id, "replica": task.replica, "l_plus": value, "l_minus": aux}
            out.append(ProbeResult(**fields) if math.isfinite(value) else non_finite_result(**fields))
        return out

    def _fast_forward(self, model: torch.nn.Module, holds: tuple, dtype: torch.dtype):
        """The `dtype` compiled forward (probe_kernels.FastForward of lm_batch_loss) holding `model`'s weights: one per
        architecture, reloaded (cast) only when `holds` (run, weight terms) changes; a new architecture replaces
        it."""

        ff = self._ff
        if ff is not None and ff.dtype == dtype and self._ff_holds == holds:
            return ff
        if ff is None or ff.dtype != dtype or not ff.load(model):
            if ff is not None:
                ff.close()
            self._ff = None
            ff = self._ff = FastForward(model, lm_batch_loss, dtype=dtype, compile=self.compile,
                                        cuda_graphs=self.cuda_graphs, segmented=self.segmented)
        self._ff_holds = holds
        return ff

    @torch.no_grad()
    def _mixture(self, run: str, terms: list[tuple[int, float]], model: torch.nn.Module) -> torch.nn.Module:
        """A scratch copy of `model` holding Σ coeff·θ_version over `terms` (trainer.anytime.ring.build_mixture)."""
        import copy

        weights = build_mixture(terms, lambda v: self.cache.get(run, v).model.state_dict())
        # Runs of one model class may differ in size (two loops on one fleet): the scratch is rebuilt whenever its
        # tensors' names, shapes or dtypes are not the model's, never loaded with another run's layout.
        if self._mix_scratch is None or _layout(self._mix_scratch) != _layout(model):
            self._mix_scratch = copy.deepcopy(model).eval()
        self._mix_scratch.load_state_dict(weights)
        return self._mix_scratch

    def rebind(self, worker_id: str) -> None:
        """Evaluate as `worker_id` from now on (the worker re-enrolled after the coordinator forgot it): results
        carry the new id and every run's canary is attested again (the coordinator lost the attestations)."""
        self.worker_id = worker_id
        self._attested.clear()

    def prefetch(self, run: str, version: int) -> None:
        """Load (run, version) into the cache ahead of its tasks, overlapped with evaluation where that is safe.

        A snapshot version loads while tasks evaluate (download, sha256, parse, model build and the copy to the
        device read no loaded model). A pure-ZO ledger version is replayed from a loaded model's parameters,
        which a probe swaps perturbed tensors into for its forward passes: that replay waits for the evaluation
        lock, so it never runs during a task's evaluation (WeightCache.get's replay_lock). A task asking for the
        version being prefetched waits for this load rather than starting a second one. `current_version` (the
        heartbeat's version) becomes `version` once it is ready. Raises what WeightCache.get raises.
        """
        self.cache.get(run, version, replay_lock=self._lock)
        # an int store is atomic; a task starting meanwhile sets the version it evaluates, as it always did
        self.current_version = version

    def withdrawn(self, task: ProbeTask, recheck_s: float = 1.0) -> bool:
        """True if the task's round was closed on the coordinator (the trainer withdrew it, took it over, or its
        run ended): the task is skipped unevaluated. One GET of the round per `recheck_s` seconds per round (a
        closed round stays closed: remembered); an unanswered GET counts as open (the task is evaluated, intake
        decides)."""
        key = (task.run, task.round_id)
        if key in self._closed:
            return True
        now = time.monotonic()
        if now - self._open_at.get(key, float("-inf")) < recheck_s:
            return False
        try:
            state = self.client.round_info(task.run, task.round_id).state
        except Exception as exc:  # noqa: BLE001 - the coordinator decides at intake anyway
            log.debug("round %s state unknown (%s); evaluating", task.round_id, exc)
            return False
        if state == "open":
            self._open_at[key] = now
            while len(self._open_at) > 10_000:
                self._open_at.pop(next(iter(self._open_at)))
            return False
        self._open_at.pop(key, None)
        self._closed[key] = None
        while len(self._closed) > 10_000:
            self._closed.popitem(last=False)
        return True

    def should_hand_back(self, task: ProbeTask, max_hand_backs: int = 10) -> bool:
        """True if this spot-check task should go to another worker: every seed of it was already
        evaluated here as another replica and kept by intake (`KEPT_AS_MINE`: intake would refuse it as
        `same_worker`). A replica this worker posted as a `duplicate` does not count: handing back for it only
        left the task to the worker intake does refuse, whose refusals spend the seed's re-dispatch bound.

        Bounded: after `max_hand_backs` hand-backs of the same task the worker evaluates it anyway (a
        one-worker fleet must not spin), leaving the decision to the coordinator's redispatch rule.
        """
        mine = [self._posted.get((task.run, task.round_id, s), set()) - {task.replica} for s in task.seeds]
        if not all(mine):
            return False
        key = (task.run, task.round_id, task.seeds[0], task.replica)
        count = self._handed_back.get(key, 0)
        if count >= max_hand_backs:
            return False
        self._handed_back[key] = count + 1
        while len(self._handed_back) > 100_000:
            self._handed_back.popitem(last=False)
        return True

    def run_task(self, task: ProbeTask) -> IntakeReply:
        """Evaluate and post a task's results and wall time (`task_s`: the run's worker-seconds); returns outcomes."""
        t0 = time.monotonic()
        results = self.evaluate(task)
        took = min(time.monotonic() - t0, MAX_TASK_S)
        reply = self.client.post_results(task.run, ResultBatch(results=results, task_s=took, schema_version=2))
        for res, outcome in zip(results, reply.outcomes, strict=False):
            if outcome in KEPT_AS_MINE:  # a duplicate is another worker's value: intake never refuses us for it
                self._posted.setdefault((task.run, task.round_id, res.seed), set()).add(task.replica)
        while len(self._posted) > 100_000:
            self._posted.popitem(last=False)
        for outcome in reply.outcomes:
            self.metrics.results.labels(outcome).inc()
        if "unattested" in reply.outcomes:
            self._attested.discard(task.run)  # the coordinator forgot us (e.g. restarted): attest again
        self.tasks_done += 1
        return reply


def _layout(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """(name, shape, dtype) of each tensor of `model`'s state dict, in order: equal for two models that can load
    each other's weights."""
    return tuple((k, tuple(t.shape), t.dtype) for k, t in model.state_dict().items())
