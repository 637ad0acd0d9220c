"""Evaluation on the fleet (fleet.evaluation.FleetEvaluator) with a real coordinator and real worker processes
(support.fleet.Fleet): the records equal the trainer's own bit for bit; a worker that never answers leaves the
trainer to evaluate (and say so), nothing missing; a worker killed mid-evaluation gets its batches re-issued and
each counts once. The wire form of an eval round is strict."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from pydantic import ValidationError

from support.events import metrics_records
from wire.round_messages import EvalSpec, ProbeRound, ProbeTask, WeightTerm

SHA = "a" * 64


def test_eval_rounds_are_strict_and_old_schemas_serialise_unchanged():
    spec = EvalSpec(split="classics-small/val", batch_size=4, weights=[WeightTerm(version=7, coeff=1.0)])
    r = ProbeRound(schema_version=3, run="r", round_id="eval-7", version=7, batch_sha256=SHA, eps=1.0,
                   distribution="rademacher", seeds=[0, 1, 2], kind="eval", eval=spec)
    assert ProbeRound.model_validate_json(r.model_dump_json()) == r
    base = {"run": "r", "round_id": "x", "version": 7, "batch_sha256": SHA, "eps": 1.0, "distribution": "rademacher",
            "seeds": [0, 1]}
    for bad in ({**base, "kind": "eval"},  # no spec
                {**base, "kind": "eval", "schema_version": 2, "eval": spec.model_dump()},  # old schema
                {**base, "kind": "seeded", "schema_version": 3, "eval": spec.model_dump()},  # spec on a probe round
                {**base, "kind": "eval", "schema_version": 3, "version": 8, "eval": spec.model_dump()}):  # not its version
        with pytest.raises(ValidationError):
            ProbeRound.model_validate(bad)
    with pytest.raises(ValidationError):  # a mixture names each version once
        EvalSpec(split="v", batch_size=1, weights=[WeightTerm(version=1, coeff=0.5), WeightTerm(version=1, coeff=0.5)])
    with pytest.raises(ValidationError):
        EvalSpec(split="v", batch_size=1, weights=[WeightTerm(version=1, coeff=float("nan"))])
    old = ProbeTask(run="r", round_id="x", version=1, batch_sha256=SHA, eps=0.1, distribution="rademacher",
                    seeds=[3], want_clean=False)
    assert "eval" not in json.loads(old.model_dump_json()) and "blocks" not in old.model_dump(mode="json")


# ---- end to end ------------------------------------------------------------------------------------------


def _cfg(tmp_path, name: str, **kw):
    from trainer.config import TrainConfig

    base = dict(model="gpt2-tiny", corpus="classics-small", steps=4, batch_size=2, seq_len=16, warmup_steps=1,
                eval_every=2, eval_batches=3, checkpoint_every=100, run_dir=tmp_path / name)
    return TrainConfig(**{**base, **kw})


def _evals(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics_records(run_dir) if "val_loss" in r}


def _attached(f, workers: int = 1, rounds: str = "async"):
    from fleet.attach import Fleet, FleetSettings, FleetStatus
    from support.fleet import REDIS_URL

    settings = FleetSettings(admin_token=f.admin_token, redis_url=REDIS_URL, key_prefix=f.prefix,
                             blob_dir=f.tmp / "blobs")
    return Fleet(f.url, settings, workers, FleetStatus(f.url), run_prefix="te", rounds=rounds)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """The reference: the same run evaluated on the trainer."""
    from trainer.train import train

    tmp = tmp_path_factory.mktemp("ref")
    res = train(_cfg(tmp, "trainer"), progress=False, export=False)
    return res.run_dir


@pytest.fixture(scope="module")
def efleet(tmp_path_factory):
    """A coordinator process and one worker "a" (more are started by the tests that need them)."""
    from support.fleet import Fleet

    f = Fleet(tmp_path_factory.mktemp("efleet"))
    try:
        f.start_worker("a")
        f.wait_consuming("a")
        yield f
    finally:
        f.close()


@pytest.mark.slow
def test_fleet_evaluation_equals_the_trainers_bit_for_bit(efleet, trainer_run, tmp_path):
    from trainer.train import TrainHooks, train

    fleet = _attached(efleet)
    res = train(_cfg(tmp_path, "fleet"), progress=False, export=False,
                hooks=TrainHooks(evaluator_factory=fleet.evaluator_factory(deadline_s=120.0, full=False)))
    mine, ref = _evals(res.run_dir), _evals(trainer_run)
    assert sorted(mine) == sorted(ref) == [0, 2, 4]
    assert [mine[s]["val_loss"] for s in (0, 2, 4)] == [ref[s]["val_loss"] for s in (0, 2, 4)]  # bits, not approx
    assert all(mine[s]["eval_on"] == "fleet" and mine[s]["eval_trainer_batches"] == 0 for s in mine)
    assert all(mine[s]["eval_fleet_batches"] == 3 for s in mine)  # eval_batches 3 (of 2 windows each)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] == ref[4]["val_loss"]
    assert summary["evaluations"] == {"fleet": 3, "trainer_fallback": 0}
    losses = [(r["step"], r["loss"]) for r in metrics_records(res.run_dir) if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in metrics_records(trainer_run) if "loss" in r]


@pytest.mark.slow
def test_a_worker_that_never_answers_leaves_the_evaluation_to_the_trainer(efleet, trainer_run, tmp_path):
    from trainer.train import TrainHooks, train

    fleet = _attached(efleet)
    proc = efleet.workers["a"]
    os.kill(proc.pid, signal.SIGSTOP)  # alive, holding whatever it took, answering nothing
    try:
        res = train(_cfg(tmp_path, "stopped"), progress=False, export=False,
                    hooks=TrainHooks(evaluator_factory=fleet.evaluator_factory(deadline_s=1.0, full=False)))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    mine, ref = _evals(res.run_dir), _evals(trainer_run)
    assert sorted(mine) == [0, 2, 4]  # nothing missing
    assert [mine[s]["val_loss"] for s in (0, 2, 4)] == [ref[s]["val_loss"] for s in (0, 2, 4)]
    assert all(mine[s]["eval_on"] == "trainer" and mine[s]["eval_fleet_batches"] == 0 for s in mine)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["evaluations"] == {"fleet": 0, "trainer_fallback": 3}
    # The run's health says so (trainer.health), and the evaluations taken over were withdrawn: at the run's end
    # its eval run is ended on the coordinator (no queue left for a worker to consume).
    assert summary["warning_counts"]["eval_fallback"] == 3, summary["warnings"]
    assert any(w.startswith("eval_fallback x3: evaluation of step 0") for w in summary["warnings"])
    assert not [r for r in efleet.r.smembers(f"{efleet.prefix}:runs") if r.startswith("te-eval-")]


@pytest.mark.slow
def test_a_stopping_run_finishes_its_evaluation_on_the_trainer_without_waiting_for_the_fleet(efleet, tmp_path):
    """The final evaluation's wait (`finish`) of a run that is stopping (the first Ctrl-C or SIGTERM of its step
    loop: STOP_REQUESTED) does not wait `deadline_s` for a worker that answers nothing: the trainer evaluates the
    batches itself at once, and the record is complete, the trainer's own value bit for bit."""
    from fleet.evaluation import FleetEvaluator
    from trainer.console import STOP_REQUESTED
    from trainer.tasks import LMTask
    from trainer.train import evaluate

    cfg = _cfg(tmp_path, "stopping")
    task = LMTask(cfg)
    model = task.build_model()
    stopping_reads: list[float] = []

    def clock() -> float:
        """No time passes for the evaluator: its deadline never runs out, so only the stop can end its wait; a wait
        that held the stop reads this clock each time it looks at the stream (every 0.05 s) and fails here."""
        if STOP_REQUESTED.is_set():
            stopping_reads.append(0.0)
            assert len(stopping_reads) < 20, "the evaluation waits for the fleet although the run is stopping"
        return 0.0

    # deadline_s: what the wait held a stop for before; the wall time is not asserted (a loaded machine stretches it)
    ev = FleetEvaluator(task, cfg, model, _attached(efleet), deadline_s=300.0, full=False, clock=clock)
    proc = efleet.workers["a"]
    os.kill(proc.pid, signal.SIGSTOP)  # alive, answering nothing
    try:
        ev.request(0, model)
        STOP_REQUESTED.set()
        records = ev.finish()
    finally:
        STOP_REQUESTED.clear()
        os.kill(proc.pid, signal.SIGCONT)
        ev.close(wait=False)
    assert [r["step"] for r in records] == [0]
    rec = records[0]
    assert rec["eval_on"] == "trainer" and rec["eval_trainer_batches"] == ev.windows.n_batches
    assert rec["val_loss"] == evaluate(model, task.corpus.val, cfg)


@pytest.mark.slow
def test_a_worker_killed_mid_evaluation_is_replaced_and_each_batch_counts_once(efleet, tmp_path):
    from fleet.evaluation import FleetEvaluator
    from trainer.tasks import LMTask
    from trainer.train import evaluate

    cfg = _cfg(tmp_path, "killed", eval_batches=120, batch_size=2, seq_len=64)
    task = LMTask(cfg)
    model = task.build_model()
    efleet.start_worker("b")
    efleet.wait_consuming("b")
    ev = FleetEvaluator(task, cfg, model, _attached(efleet), deadline_s=300.0, full=False, seeds_per_task=1)
    n = ev.windows.n_batches
    assert n == 120
    victim = efleet.workers["b"]
    ev.request(0, model)

    def progress() -> int:
        return len(ev.pending[0].values) if 0 in ev.pending else n

    deadline = time.monotonic() + 120
    while progress() < 3 and time.monotonic() < deadline:  # mid-evaluation: some batches in, most not
        ev.poll()
        time.sleep(0.05)
    assert 3 <= progress() < n, "the worker finished before it could be killed: make the evaluation longer"
    victim.kill()
    victim.wait()
    efleet.start_worker("c")  # its replacement; the dead worker's task returns to the queue, its seeds re-issued
    records = ev.finish()
    ev.close()
    assert [r["step"] for r in records] == [0]
    rec = records[0]
    assert rec["eval_on"] == "fleet" and rec["eval_fleet_batches"] == n
    assert rec["val_loss"] == evaluate(model, task.corpus.val, cfg)  # the trainer's own value, bit for bit
    info = efleet.admin.get(f"/v1/runs/{ev.run}/rounds/eval-0").json()
    assert info["done"] == info["n_seeds"] == n  # each batch accepted exactly once


@pytest.mark.slow
def test_fleet_wait_never_with_a_stopped_worker_finishes_and_counts_its_skipped_rounds(efleet, tmp_path):
    """--fleet-wait never (round mode "async"): the worker answers nothing, the trainer never waits for a round;
    every step is taken, each round goes stale unfolded and is counted, and the ledger books no waiting."""
    from trainer.train import TrainHooks, train

    fleet = _attached(efleet, rounds="async")
    cfg = _cfg(tmp_path, "never", optimizer="zocurv-line", steps=8, curvature_interval=2, staleness=2,
               probe_batch_size=2, eval_every=8)
    alive = [p for p in efleet.workers.values() if p.poll() is None]
    for p in alive:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        res = train(cfg, progress=False, export=False, hooks=TrainHooks(mode_factory=fleet.mode_factory))
    finally:
        for p in alive:
            os.kill(p.pid, signal.SIGCONT)
    steps = [r["step"] for r in metrics_records(res.run_dir) if "loss" in r]
    assert steps == list(range(1, 9))  # the same step count as without a fleet
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["rounds_skipped"]["dropped"] >= 1  # rounds at steps 2 and 4 went stale unanswered
    assert summary["rounds_skipped"]["dropped"] + summary["rounds_skipped"]["pending_at_end"] == 3  # rounds 2, 4, 6
    assert summary["time_ledger"]["phases_s"]["wait"] == 0.0
    assert summary["time_ledger"]["phases_s"]["publish"] > 0.0


@pytest.mark.slow
def test_a_weight_mixture_is_built_on_the_worker_bit_for_bit_as_in_process(efleet, tmp_path):
    """An eval round whose weights are Σ c·θ_v over three published versions (an anytime candidate): the worker
    builds the mixture from its cache with trainer.anytime.ring.build_mixture, so each batch's loss equals the
    in-process build's, bit for bit, whatever order the terms arrive in."""
    import copy

    import torch

    from fleet.evaluation import FleetEvaluator
    from trainer.anytime.ring import build_mixture
    from trainer.evaluation import batch_values
    from trainer.tasks import LMTask
    from trainer.zo.probes import canonical_blocks
    from wire.round_messages import ProbeRound

    cfg = _cfg(tmp_path, "mix", eval_batches=3)
    task = LMTask(cfg)
    model = task.build_model()
    ev = FleetEvaluator(task, cfg, model, _attached(efleet), full=False)
    gen = torch.Generator().manual_seed(31)
    states = {}
    with torch.no_grad():
        for v in (1, 2, 3):  # three versions: the model nudged by seeded noise between them
            for b in canonical_blocks(model):
                b.param.add_(torch.randn(b.param.shape, generator=gen) * 0.02)
            ev.backend.publish(v, weights=[b.param.detach().to("cpu", copy=True) for b in canonical_blocks(model)])
            states[v] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    terms = [(3, 0.5), (1, 0.125), (2, 0.375)]  # out of order on purpose: the sum is in ascending version order
    n = ev.windows.n_batches
    wire = ProbeRound(schema_version=3, run=ev.run, round_id="mix-1", version=3, batch_sha256=ev.blob_sha, eps=1.0,
                      distribution="rademacher", seeds=list(range(n)), kind="eval",
                      eval=EvalSpec(split=ev.windows.split, batch_size=ev.windows.batch_size,
                                    weights=[WeightTerm(version=v, coeff=c) for v, c in terms]))
    ev.backend.submit_wire(wire, ev.blob)
    got: dict[int, float] = {}
    deadline = time.monotonic() + 240
    while len(got) < n and time.monotonic() < deadline:
        for r in ev.backend.collect().results:
            if r.round_id == "mix-1":
                got.setdefault(int(r.seed), r.l_plus)
        time.sleep(0.05)
    ev.close()
    scratch = copy.deepcopy(model)
    scratch.load_state_dict(build_mixture(terms, states.__getitem__))
    ref = [batch_values(scratch, ev.windows.kind, ev.windows.batch(k, "cpu"))[0] for k in range(n)]
    assert [got.get(k) for k in range(n)] == ref  # bits, not approx
    assert ref != [batch_values(model, ev.windows.kind, ev.windows.batch(k, "cpu"))[0] for k in range(n)]


@pytest.mark.slow
def test_anytime_candidates_scored_on_the_fleet_choose_as_in_process_bit_for_bit(efleet, tmp_path, monkeypatch):
    """`train --anytime` with a fleet evaluator: every candidate is an eval round of a weight mixture scored by the
    worker (fleet.anytime.FleetScorer); the selection losses, the served choice and its losses equal the
    in-process run's bit for bit (one selection code path, two scorers)."""
    import trainer.data.corpus as corpus_mod
    from trainer.anytime.serve import InProcessScorer
    from trainer.anytime.settings import AnytimeSettings
    from trainer.train import TrainHooks, train

    corpus = "test-milton-select"  # as tests/trainer/test_anytime_train.py: milton with a selection split
    monkeypatch.setitem(corpus_mod.CORPORA, corpus, ("milton",))
    monkeypatch.setattr(corpus_mod, "SELECT_CORPORA", corpus_mod.SELECT_CORPORA | {corpus})
    anytime = AnytimeSettings(k=4, publish_every=2, select_batches=2, half_lives=(1.0, 2.0), windows=(2, 4))

    def cfg(name):
        return _cfg(tmp_path, name, corpus=corpus, steps=8, batch_size=2, seq_len=16, lr=3e-3, eval_every=4,
                    eval_batches=2, anytime=anytime)

    ref = train(cfg("inproc"), progress=False, export=False)

    def refuse(*a, **kw):
        raise AssertionError("a fleet run scored a candidate in process")

    monkeypatch.setattr(InProcessScorer, "__call__", refuse)  # the fleet run must score on the worker
    res = train(cfg("fleet-any"), progress=False, export=False,
                hooks=TrainHooks(evaluator_factory=_attached(efleet).evaluator_factory(deadline_s=240.0, full=False)))
    keys = ("served", "served_versions", "served_coefs", "served_sel_loss", "raw_sel_loss", "served_val_loss",
            "served_z", "candidates", "quad_ok", "quad_resid", "quad_pred", "quad_meas")

    def served(run_dir):  # a fleet's evaluation record may come later than the served figures: a record of their own
        return {r["step"]: {k: r.get(k) for k in keys} for r in metrics_records(run_dir) if "served" in r}

    mine, theirs = served(res.run_dir), served(ref.run_dir)
    assert sorted(mine) == [4, 8] and mine == theirs  # bits, not approx
    assert all(mine[s]["candidates"] >= 4 for s in mine)
    evals = _evals(res.run_dir)
    assert {s: r["val_loss"] for s, r in evals.items()} == {s: r["val_loss"] for s, r in _evals(ref.run_dir).items()}
    assert all(r["eval_on"] == "fleet" for r in evals.values())
