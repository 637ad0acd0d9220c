"""End-to-end fleet tests: real Redis (DB 12, unique key/queue prefix), a real coordinator process
(uvicorn in a subprocess), real probe-worker processes (`python -m probe_worker.cli`, Celery solo pool),
and the trainer side through `CoordinatorBackend`.

The tests share one fleet (conftest.py's `fleet`: a coordinator and workers a, b) and run in file order
(equivalence, elastic, kill), because starting worker processes dominates the cost on a 2-core machine.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import torch

from probe_kernels import ProbeEvaluator
from probe_worker.drain_signals import threads_taking_drain_signals
from support.fleet import make_batch
from support.models import tiny_gpt2
from trainer.train import lm_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import RoundSpec

pytestmark = pytest.mark.slow  # a coordinator process and probe-worker processes


def loss_fn(model, batch):
    """The loss the fleet's workers use: mean token cross-entropy of (x, y)."""
    return lm_loss(model, batch[0], batch[1])


def _by_seed(results):
    out = {}
    for r in results:
        assert r.seed not in out, f"seed {r.seed} delivered twice"
        out[r.seed] = r
    return out


def test_fleet_equals_in_process(fleet):
    """A round through coordinator + 2 worker processes returns bit-identical L+, L-, L0 to the in-process
    backend and to the kernels' ProbeEvaluator, for both distributions and two versions."""
    model = tiny_gpt2()
    be = fleet.backend(model, "equiv")
    ids = {fleet.wait_consuming("a"), fleet.wait_consuming("b")}
    ref = InProcessBackend(model, loss_fn)
    batch = make_batch(4, 16, seed=1)
    for version, dist in ((0, "gauss8"), (1, "rademacher")):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # a real new version: every weight changed
        be.publish(version)
        ref.publish(version)
        seeds = tuple(range(1000 + 10 * version, 1008 + 10 * version))
        rnd = RoundSpec(f"eq-{version}", version, batch, eps=1e-2, seeds=seeds, distribution=dist, want_clean=True)
        be.submit(rnd)
        fleet_res = _by_seed(be.collect(rnd.round_id).results)
        ref.submit(rnd)
        ref_res = _by_seed(ref.collect(rnd.round_id).results)
        assert set(fleet_res) == set(seeds)
        ev = ProbeEvaluator(model, loss_fn)
        for s in seeds:
            f, r = fleet_res[s], ref_res[s]
            assert (f.l_plus, f.l_minus, f.l0, f.version) == (r.l_plus, r.l_minus, r.l0, version)
            assert f.l_plus == ev.loss(batch, s, 1e-2, dist) and f.l_minus == ev.loss(batch, s, -1e-2, dist)
            assert f.l_plus != f.l_minus  # the perturbation really moved the loss
            assert f.worker in ids
        ev.close()
    assert be.collect().results == []  # nothing delivered twice
    be.close()


def test_elastic_drain_and_join(fleet):
    """A worker drained over REST evaluates nothing and loses nothing; a worker started mid-run receives
    tasks; SIGUSR1 drains locally and SIGUSR2 resumes."""
    model = tiny_gpt2()
    be = fleet.backend(model, "elastic")
    id_a, id_b = fleet.wait_consuming("a"), fleet.wait_consuming("b")
    be.publish(0)
    batch = make_batch(4, 16, seed=2)
    assert fleet.admin.post(f"/v1/workers/{id_a}/drain").json()["state"] == "draining"
    fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_draining") == 1.0, "worker a draining")
    done_a = fleet.metric("a", "sparecycles_worker_probes_evaluated_total")
    fleet.start_worker("c")
    id_c = fleet.wait_consuming("c")
    seeds = tuple(range(2000, 2024))
    be.submit(RoundSpec("el-0", 0, batch, eps=1e-2, seeds=seeds, distribution="gauss8"))
    res = _by_seed(be.collect("el-0").results)
    assert set(res) == set(seeds)
    workers = {r.worker for r in res.values()}
    assert id_a not in workers and id_c in workers and workers <= {id_b, id_c}
    assert fleet.metric("a", "sparecycles_worker_probes_evaluated_total") == done_a

    # Resume a over REST, then drain b and c locally with SIGUSR1: only a may evaluate the next round.
    assert fleet.admin.post(f"/v1/workers/{id_a}/resume").json()["state"] == "active"
    fleet.wait(lambda: fleet.metric("a", "sparecycles_worker_draining") == 0.0, "worker a resumed")
    for name in ("b", "c"):
        fleet.workers[name].send_signal(signal.SIGUSR1)
    for name in ("b", "c"):
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 1.0, f"worker {name} drained")
    for name in ("b", "c"):  # every thread of the real worker holds them: none can reach a replaced handler
        pid = fleet.workers[name].pid
        open_ = threads_taking_drain_signals(pid)
        assert open_ == [], [(t, t == pid, Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()) for t in open_]
    seeds = tuple(range(2100, 2108))
    be.submit(RoundSpec("el-1", 0, batch, eps=1e-2, seeds=seeds, distribution="rademacher"))
    res = _by_seed(be.collect("el-1").results)
    assert set(res) == set(seeds) and {r.worker for r in res.values()} == {id_a}
    for name in ("b", "c"):
        fleet.workers[name].send_signal(signal.SIGUSR2)
    for name in ("b", "c"):
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 0.0, f"worker {name} resumed")
    be.close()


def test_lying_worker_is_quarantined_and_never_used(fleet):
    """With every seed spot-checked, a worker that posts wrong losses first is outvoted by two honest
    worker processes, quarantined, and the trainer receives only the honest (in-process) values."""
    model = tiny_gpt2(seed=4)
    be = fleet.backend(model, "trust", spot_check_fraction=1.0, seeds_per_task=1)
    ids = {name: fleet.wait_consuming(name) for name in ("a", "b", "c")}
    be.publish(0)
    batch = make_batch(4, 16, seed=4)
    for wid in ids.values():  # hold the honest fleet back so the liar's values are the first replica
        fleet.admin.post(f"/v1/workers/{wid}/drain")
    for name in ids:
        fleet.wait(lambda name=name: fleet.metric(name, "sparecycles_worker_draining") == 1.0, f"{name} draining")
    seeds = (4000, 4001, 4002)
    rnd = RoundSpec("t-0", 0, batch, eps=1e-2, seeds=seeds, distribution="gauss8")
    be.submit(rnd)
    enroll = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {fleet.enroll_token}"})
    reg = enroll.post("/v1/workers", json={"name": "liar"}).json()
    liar = httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {reg['worker_token']}"})
    lies = [{"run": "trust", "round_id": "t-0", "seed": s, "version": 0, "worker_id": reg["worker_id"],
             "replica": 0, "l_plus": 1.0, "l_minus": 2.0} for s in seeds]
    assert liar.post("/v1/runs/trust/results", json={"results": lies}).json()["outcomes"] == ["held"] * 3
    for wid in ids.values():
        fleet.admin.post(f"/v1/workers/{wid}/resume")
    got = be.collect("t-0")
    res = _by_seed(got.results)
    ref = InProcessBackend(model, loss_fn)
    ref.submit(rnd)
    truth = _by_seed(ref.collect("t-0").results)
    # no honest seed given up (tests/coordinator/test_spot_give_up.py drives the orderings that once dropped one here)
    assert (got.counts["dropped"], got.counts["retracted"]) == (0, 0)
    assert set(res) == set(seeds)
    for s in seeds:
        assert (res[s].l_plus, res[s].l_minus) == (truth[s].l_plus, truth[s].l_minus)
        assert res[s].worker in set(ids.values())
    assert fleet.admin.get(f"/v1/workers/{reg['worker_id']}").json()["state"] == "quarantined"
    assert liar.post("/v1/runs/trust/results", json={"results": lies[:1]}).json()["outcomes"] == ["quarantined"]
    enroll.close()
    liar.close()
    be.close()


def test_sigkill_mid_round_loses_nothing(fleet):
    """SIGKILL a worker while it evaluates a task: its task is redelivered after the visibility timeout and
    every seed reaches the trainer exactly once (one accepted stream event per seed)."""
    model = tiny_gpt2(n_embd=64, n_layer=4, seed=3)
    be = fleet.backend(model, "kill")
    for name in ("a", "b", "c"):
        fleet.wait_consuming(name)
    be.publish(0)
    batch = make_batch(8, 48, seed=3)
    seeds = tuple(range(3000, 3024))
    be.submit(RoundSpec("k-0", 0, batch, eps=1e-2, seeds=seeds, distribution="gauss8", want_clean=True))
    log_b = fleet.tmp / "b.log"
    fleet.wait(lambda: log_b.read_text().count("round k-0 seeds") >= 1, "worker b to finish a task")
    fleet.wait(lambda: log_b.read_text().rsplit("round k-0 seeds", 1)[1].count("] received") >= 1,
               "worker b to start its next task")
    fleet.workers["b"].send_signal(signal.SIGKILL)
    fleet.workers["b"].wait(timeout=60)
    tail = log_b.read_text().rsplit("] received", 1)[1]
    assert "succeeded" not in tail  # b died inside a task, before acknowledging it
    res = _by_seed(be.collect("k-0").results)
    assert set(res) == set(seeds)
    l0s = {r.l0 for r in res.values()}
    assert len(l0s) == 1  # every worker computed the same clean loss
    stream = fleet.r.xrange(f"{fleet.prefix}:{{kill}}:results")
    accepted = [e for _, e in stream if '"accepted"' in e["e"]]
    assert len(accepted) == len(seeds)
    be.close()


def test_coordinator_restart_mid_round_loses_and_doubles_nothing(fleet):
    """SIGKILL the coordinator while workers evaluate a round and start a new one on the same port: the
    workers retry/requeue, the round completes, one accepted stream event per seed, values unchanged."""
    model = tiny_gpt2(seed=7)
    be = fleet.backend(model, "restart")
    for name in ("a", "c"):
        fleet.wait_consuming(name)
    be.publish(0)
    batch = make_batch(4, 32, seed=7)
    seeds = tuple(range(5000, 5040))
    rnd = RoundSpec("rs-0", 0, batch, eps=1e-2, seeds=seeds, distribution="rademacher", want_clean=True)
    be.submit(rnd)
    stream_key = f"{fleet.prefix}:{{restart}}:results"
    fleet.wait(lambda: fleet.r.xlen(stream_key) >= 2, "first results")
    fleet.coord.send_signal(signal.SIGKILL)
    fleet.coord.wait(timeout=60)
    assert fleet.r.xlen(stream_key) < len(seeds)  # the round really was cut mid-way
    fleet.start_coordinator()
    fleet.wait(fleet._ready, "restarted coordinator")
    res = _by_seed(be.collect("rs-0").results)
    assert set(res) == set(seeds)
    ref = InProcessBackend(model, loss_fn)
    ref.submit(rnd)
    for r in ref.collect("rs-0").results:
        assert (res[r.seed].l_plus, res[r.seed].l_minus, res[r.seed].l0) == (r.l_plus, r.l_minus, r.l0)
    accepted = [e for _, e in fleet.r.xrange(stream_key) if '"accepted"' in e["e"]]
    assert len(accepted) == len(seeds)
    be.close()
