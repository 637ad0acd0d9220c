"""A coordinator whose Redis comes back empty (restart without persistence, failover to a fresh replica, a flush):
real Redis, a real coordinator process and real probe-worker processes (support.fleet.Fleet); the store is lost by
deleting every key of the fleet's prefix mid-run (what a FLUSHALL does to this fleet, without touching the other
tests sharing the server).

Workers re-enroll with their enrollment token (a new id, counted, one log line per state change); the trainer
re-creates its run, re-publishes its current version and re-issues the rounds in flight (fleet.recovery).
"""

from __future__ import annotations

import pytest

from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
from support.fleet import make_batch
from support.models import tiny_gpt2
from trainer.zo.probes import RoundSpec


def test_results_stream_reports_a_lost_group_and_reads_on(redis_url):
    """A results stream whose key is deleted under the reader (its group with it): the next read re-creates the group
    and raises StreamLost once; reads then go on from the new stream's start."""
    import secrets

    import redis

    from coordinator.keys import results_stream_key
    from coordinator.stream import ResultStreamReader, StreamLost

    prefix = "tl" + secrets.token_hex(4)
    reader = ResultStreamReader(redis_url, "run", key_prefix=prefix)
    r = redis.Redis.from_url(redis_url)
    try:
        assert reader.read(block_ms=0) == []
        r.delete(results_stream_key(prefix, "run"))
        with pytest.raises(StreamLost):
            reader.read(block_ms=0)
        assert reader.groups_recreated == 1 and reader.read(block_ms=0) == [] and reader.groups_recreated == 1
    finally:
        r.delete(results_stream_key(prefix, "run"))
        reader.r.close()
        r.close()


def lose_store(fleet) -> int:
    """Delete every Redis key of `fleet` (registry, runs, rounds, streams, queues, kombu bindings); returns how
    many. The coordinator process keeps running on the now empty store."""
    keys = [k for pattern in (f"{fleet.prefix}*", f"_kombu.binding*.{fleet.prefix}*")
            for k in fleet.r.scan_iter(pattern, count=1000)]
    if keys:
        fleet.r.delete(*keys)
    return len(keys)


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_workers_reenroll_after_the_store_is_lost(fleet):
    """Both workers notice at their next heartbeat, re-enroll under new ids (sparecycles_worker_reenrollments_total
    1 each), log the loss once (not twice a second) and evaluate the next run's rounds."""
    old = {name: fleet.wait_consuming(name) for name in ("a", "b")}
    assert lose_store(fleet) > 0
    fleet.wait(lambda: all((fleet.worker_info(n) or {}).get("worker_id") not in (None, old[n]) for n in old),
               "both workers re-enrolled")
    new = {name: fleet.wait_consuming(name) for name in old}
    assert set(new.values()).isdisjoint(old.values())
    for name in old:
        assert fleet.metric(name, "sparecycles_worker_reenrollments_total") == 1.0
        log = (fleet.tmp / f"{name}.log").read_text()
        assert log.count("coordinator no longer knows this worker") == 1, log[-3000:]
        assert log.count(f"re-enrolled as {new[name]} (was {old[name]})") == 1, log[-3000:]

    model = tiny_gpt2()
    be = fleet.backend(model, "after-loss")
    be.publish(0)
    seeds = tuple(range(10, 18))
    be.submit(RoundSpec("after-0", 0, make_batch(2, 8, seed=3), eps=1e-2, seeds=seeds, distribution="rademacher"))
    got = be.collect("after-0").results
    assert sorted(r.seed for r in got) == list(seeds)
    assert {r.worker for r in got} <= set(new.values())
    be.close()


def _attached(fleet, run_prefix: str):
    """fleet.attach.Fleet for the test fleet `fleet` (what `train --coordinator` attaches to), two workers."""
    from fleet.attach import Fleet, FleetSettings, FleetStatus
    from support.fleet import REDIS_URL

    settings = FleetSettings(admin_token=fleet.admin_token, redis_url=REDIS_URL, key_prefix=fleet.prefix,
                             blob_dir=fleet.tmp / "blobs")
    return Fleet(fleet.url, settings, 2, FleetStatus(fleet.url), run_prefix=run_prefix)


def _recreated(run: str) -> float:
    """sparecycles_trainer_runs_recreated_total{run} of this process (0 when never counted)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sparecycles_trainer_runs_recreated_total", {"run": run}) or 0.0


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_an_evaluation_in_flight_when_the_store_is_lost_is_reissued(fleet, tmp_path):
    """fleet.evaluation.FleetEvaluator (a coordinator run of its own) with an evaluation in flight when the store is
    lost: the run is created again (counted), the version published again from its host copy and only the batches
    not yet in re-issued; the record comes from the fleet, equal to the trainer's own value bit for bit."""
    import time

    from fleet.evaluation import FleetEvaluator
    from trainer.config import TrainConfig
    from trainer.tasks import LMTask
    from trainer.train import evaluate

    for name in ("a", "b"):
        fleet.wait_consuming(name)
    cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", steps=4, batch_size=2, seq_len=64, warmup_steps=1,
                      eval_every=2, eval_batches=120, checkpoint_every=100, run_dir=tmp_path / "ev")
    task = LMTask(cfg)
    model = task.build_model()
    ev = FleetEvaluator(task, cfg, model, _attached(fleet, "tl"), deadline_s=300.0, full=False, seeds_per_task=1)
    n = ev.windows.n_batches
    try:
        ev.request(0, model)
        deadline = time.monotonic() + 120
        while len(ev.pending[0].values) < 3 and time.monotonic() < deadline:  # some batches in, most not
            ev.poll()
            time.sleep(0.05)
        had = len(ev.pending[0].values)
        assert 3 <= had < n, f"{had} of {n} batches in: lose the store mid-evaluation (make it longer or wait more)"
        assert lose_store(fleet) > 0
        records = ev.finish()
    finally:
        ev.close()
    assert [r["step"] for r in records] == [0]
    rec = records[0]
    info = fleet.admin.get(f"/v1/runs/{ev.run}/rounds/eval-0").json()  # the round re-issued on the new store
    why = f"{rec} {info} had {had}"
    assert rec["eval_on"] == "fleet" and rec["eval_fleet_batches"] == n and rec["eval_trainer_batches"] == 0, why
    assert rec["val_loss"] == evaluate(model, task.corpus.val, cfg), why  # bits, not approx
    assert ev.backend.recreated == 1 and _recreated(ev.run) == 1.0, why
    assert info["n_seeds"] == n - had and info["done"] == info["n_seeds"], why  # only the batches not yet in


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_anytime_candidates_are_scored_after_the_store_is_lost(fleet, tmp_path):
    """fleet.anytime.FleetScorer (a coordinator run of its own): after the store is lost between two selections,
    the second one's candidates are scored by the workers all the same (the ring published again, the candidates
    re-issued), bit for bit as the trainer scores them, and the run's re-creation is counted."""
    import copy

    import numpy as np
    import torch

    from fleet.anytime import FleetScorer
    from trainer.anytime.ring import VersionRing
    from trainer.evaluation import lm_windows
    from trainer.zo.probes import canonical_blocks

    for name in ("a", "b"):
        fleet.wait_consuming(name)
    model = tiny_gpt2()
    ring = VersionRing(3)
    gen = torch.Generator().manual_seed(5)
    scratch = copy.deepcopy(model)
    with torch.no_grad():
        for v in (2, 4, 6):  # three versions: seeded noise between them
            for b in canonical_blocks(scratch):
                b.param.add_(torch.randn(b.param.shape, generator=gen) * 0.02)
            ring.publish(v, scratch.state_dict())
    tokens = np.random.default_rng(5).integers(0, 128, 2000).astype(np.uint16)  # the selection split, (N,)
    scorer = FleetScorer(ring, model, lm_windows(tokens, 2, 8, 3, split="test/select"), fleet=_attached(fleet, "ta"),
                         model_preset=None, deadline_s=300.0)
    cands = [("raw", (0.0, 0.0, 1.0)), ("mix", (0.25, 0.25, 0.5))]
    try:
        first = scorer(cands)
        assert lose_store(fleet) > 0
        second = scorer(cands)
    finally:
        scorer.close()
    here = [torch.tensor([scorer._score_here(ring.spec(name, c), [k])[k] for k in range(3)], dtype=torch.float64)
            for name, c in cands]
    assert scorer.fallback_batches == 0  # every batch of both selections scored by the workers
    assert all(torch.equal(a, b) and torch.equal(a, h) for a, b, h in zip(first, second, here, strict=True))
    assert scorer.backend.recreated == 1 and _recreated(scorer.run) == 1.0


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_training_run_outlives_a_lost_store(fleet, tmp_path):
    """`sparecycles train --coordinator` (zocurv-line, --fleet-sync: each round awaited) whose coordinator loses its
    store mid-run, preferably while a round is in flight: the trainer creates its run again (logged, counted in
    every later step's `fleet_runs_recreated`), and its fleet evaluation's run too (fleet.evaluation, found lost at
    its next evaluation); the workers re-enroll, and the run finishes all its steps and evaluations."""
    import json
    import re
    import subprocess
    import sys
    import time

    from support.fleet import ROOT, _free_port

    for name in ("a", "b"):
        fleet.wait_consuming(name)
    before = {name: fleet.metric(name, "sparecycles_worker_reenrollments_total") for name in ("a", "b")}
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "sparecycles.cli", "train", "--coordinator", fleet.url, "--optimizer", "zocurv-line",
           "--preset", "demo", "--steps", "18", "--batch-size", "4", "--seq-len", "32", "--curvature-interval", "3",
           "--eval-every", "9", "--eval-windows", "subset", "--eval-batches", "8", "--fleet-sync", "--no-export",
           "--no-progress", "--metrics-port", str(_free_port()), "--run-dir", str(run_dir)]
    # --eval-windows subset: the whole validation split's tasks (64 batches each) would outlast this fleet's 5 s
    # visibility timeout on a loaded 2-core machine and be redelivered while they run.
    proc = subprocess.Popen(cmd, env={**fleet.env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        def steps() -> int:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
            return max((json.loads(line)["step"] for line in lines), default=0)

        def round_open() -> bool:
            return any(fleet.r.scard(k) for k in fleet.r.scan_iter(f"{fleet.prefix}:*rounds:open", count=1000))

        fleet.wait(lambda: proc.poll() is None and steps() >= 4 or proc.poll() is not None, "step 4", 600)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        deadline = time.monotonic() + 30  # lose the store with a round in flight if one opens in time
        while not round_open() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert steps() < 18 and lose_store(fleet) > 0
        out = proc.communicate(timeout=600)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 19))
    assert [r for r in recs if "loss" in r][-1]["fleet_runs_recreated"] == 1.0
    lost = re.findall(r"the coordinator lost run (train-(?:eval-)?[0-9a-f]{8}) ", out)
    assert len(lost) == 2 and sorted(r.startswith("train-eval-") for r in lost) == [False, True], out[-3000:]
    assert sorted(r["step"] for r in recs if "val_loss" in r) == [0, 9, 18]  # no evaluation lost
    fleet.wait(lambda: all(fleet.metric(n, "sparecycles_worker_reenrollments_total") == before[n] + 1
                           for n in before), "both workers re-enrolled once more")


@pytest.mark.slow  # a coordinator process and probe-worker processes
def test_worker_with_its_own_broker_user_restarts_into_its_new_identity(tmp_path):
    """With per-worker broker users (SPARECYCLES_BROKER_ACL) a Valkey restarted empty (its files deleted) forgets the
    worker and its broker user: the worker re-enrolls, restarts its own process with the new broker credentials
    (same pid, the count carried over) and evaluates the next run's rounds."""
    import shutil
    import time

    from support.fleet import AclFleet
    from support.valkey import Valkey

    v = Valkey(tmp_path / "valkey")
    v.start()

    fleet = AclFleet(tmp_path, v.url)
    try:
        proc = fleet.start_worker("a")
        old = fleet.wait_consuming("a")
        v.stop()
        shutil.rmtree(v.data)
        v.data.mkdir()
        v.start()  # empty: no state, no broker users
        deadline = time.monotonic() + 120
        while (fleet.worker_info("a") or {}).get("worker_id") in (None, old):
            assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.2)
        new = fleet.wait_consuming("a")
        assert proc.poll() is None  # the same process (exec), still running
        log = (tmp_path / "a.log").read_text()
        assert "with new broker credentials; restarting the worker process" in log
        fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_reenrollments_total") == 1.0, "the count carried over")

        from wire.messages import RunSpec

        model = tiny_gpt2()
        be = CoordinatorBackend.connect(model, RunSpec(run="acl-after", model_class=type(model).__name__,
                                                       spot_check_fraction=0.0, seeds_per_task=2),
                                        FleetAddress(fleet.url, fleet.admin_token, v.url, fleet.prefix),
                                        BackendTuning(round_timeout_s=120.0))
        be.publish(0)
        seeds = tuple(range(30, 34))
        be.submit(RoundSpec("acl-after-0", 0, make_batch(2, 8, seed=4), eps=1e-2, seeds=seeds,
                            distribution="rademacher"))
        got = be.collect("acl-after-0").results
        assert sorted(r.seed for r in got) == list(seeds) and {r.worker for r in got} == {new}
        be.close()
    finally:
        fleet.close()
        v.stop()
