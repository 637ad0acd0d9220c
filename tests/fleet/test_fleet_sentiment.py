"""The sentiment task over a real fleet: real Redis (DB 12), a coordinator process and two probe-worker processes
(conftest.py's `fleet`) evaluating the pretrained MiniLM-L6 classifier, which the workers build from the
published manifest alone (class + config + shards; their cache folder holds no model files).

Both tests share the fleet (module scope); starting worker processes dominates the cost on 2 cores.
"""

from __future__ import annotations

import copy

import pytest
import torch

from support.fleet import Fleet
from trainer.sentiment import classifier_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.zo_step import ZOStepper
from wire.batch import encode_batch
from wire.round_messages import ProbeRound as WireRound

SENTENCES = ["a gripping, beautifully acted film", "dull, lifeless and far too long",
             "not bad at all, really", "an utter mess from start to finish"]

pytestmark = pytest.mark.slow  # a coordinator process and probe-worker processes with MiniLM-L6


@pytest.fixture(scope="module")
def minilm():
    """(model in train mode, as train() holds it; dropout is 0, so forwards are deterministic), a real batch."""
    from trainer.models import load_minilm_classifier

    model, tokenizer = load_minilm_classifier(seed=0)
    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")  # padded: the mask has zeros
    batch = (enc["input_ids"], enc["attention_mask"], torch.tensor([1, 0, 1, 0]))
    assert bool((batch[1] == 0).any())
    return model.train(), batch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The workers run with --threads 1; CPU kernels' reduction order can depend on the thread count (torch
    2.13: one probe loss of this test differs in its last bits at 2 threads), so the in-process reference
    runs with one thread too: bit-identical results need the same arithmetic, thread count included."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tasks(fleet: Fleet, name: str, outcome: str) -> float:
    """sparecycles_worker_tasks_total{outcome=...} scraped from worker `name` (0 before the first such task)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{fleet.metrics_ports[name]}/metrics", timeout=10).text
    line = f'sparecycles_worker_tasks_total{{outcome="{outcome}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_one_and_a_half_spsa_steps_through_the_fleet_equal_in_process(fleet, minilm):
    """Two 1.5-SPSA steps (K=2, weight decay on matrices) whose probes the two worker processes evaluate leave the
    classifier's weights and every logged scalar bit-identical to the same steps in process. Version 0 travels as
    a snapshot; version 1 as a seed-ledger entry (decay scale on matrices only), replayed by the workers."""
    model, batch = minilm
    m_fleet, m_ref = copy.deepcopy(model), copy.deepcopy(model)
    be = fleet.backend(m_fleet, "senti", seeds_per_task=1)
    fleet.wait_consuming("a"), fleet.wait_consuming("b")
    ref = InProcessBackend(m_ref, classifier_loss)
    kw = {"run_seed": 11, "probes": 2, "eps": 1e-3, "weight_decay": 0.1}
    st_f, st_r = ZOStepper(m_fleet, "1.5spsa", **kw), ZOStepper(m_ref, "1.5spsa", **kw)
    for step in range(2):
        got, want = st_f.step(step, batch, be, lr=1e-3), st_r.step(step, batch, ref, lr=1e-3)
        # the coordinator's intake counts are the fleet's own: a task redelivered under load (visibility
        # timeout) is evaluated twice and its second value counted duplicate, which a one-process run cannot see
        intake = ("probe_duplicate", "probe_stale")
        assert {k: v for k, v in got.items() if k not in intake} == {k: v for k, v in want.items() if k not in intake}
        assert want["probe_duplicate"] == want["probe_stale"] == got["probe_stale"] == 0
        assert got["probe_accepted"] == 2 * (step + 1) and got["loss"] > 0.5
        assert all(torch.equal(a, b) for a, b in zip(m_fleet.parameters(), m_ref.parameters())), step
    assert all(torch.equal(a, b) for a, b in zip(m_fleet.parameters(), m_ref.parameters()))
    assert not torch.equal(m_fleet.classifier.weight, model.classifier.weight)  # the steps moved theta
    assert be.published == [0, 1, 2]
    assert fleet.admin.get("/v1/runs/senti/versions").json() == [0]  # 1 and 2 are ledger entries
    assert be.forward_passes == 2 * (2 * 2 + 1)
    replayed = sum(fleet.metric(n, "sparecycles_worker_ledger_entries_replayed_total") for n in ("a", "b"))
    assert replayed >= 1  # version 1 was rebuilt by replay where it was probed
    be.close()


def test_malformed_batches_are_rejected_counted_and_survived(fleet, minilm):
    """Rounds whose batch blob is garbage, of the LM kind, or labelled outside the head's 2 classes are refused by
    the workers before any forward pass (tasks_total{outcome="invalid"}, not "error"); the workers stay up and
    the next well-formed round completes with the in-process values."""
    model, batch = minilm
    be = fleet.backend(model, "senti-bad", seeds_per_task=1)
    fleet.wait_consuming("a"), fleet.wait_consuming("b")  # their /metrics answer (this test may run first)
    be.publish(0)
    ids, mask, _ = batch
    bad = [b"garbage, not a safetensors batch", encode_batch((ids, ids.clone()), "lm"),
           encode_batch((ids, mask, torch.tensor([1, 0, 5, 0])), "classifier")]
    before = sum(_tasks(fleet, n, "invalid") for n in ("a", "b"))
    errors = sum(_tasks(fleet, n, "error") for n in ("a", "b"))
    for i, data in enumerate(bad):
        wire = WireRound(run="senti-bad", round_id=f"bad-{i}", version=0, batch_sha256=be.publisher.blobs.upload(data), eps=1e-3,
                         distribution="rademacher", seeds=[100 + i], want_clean=True)
        be.client.post_round(wire)
    fleet.wait(lambda: sum(_tasks(fleet, n, "invalid") for n in ("a", "b")) == before + len(bad), "3 rejections")
    assert sum(_tasks(fleet, n, "error") for n in ("a", "b")) == errors
    assert all(p.poll() is None for p in fleet.workers.values())
    st_f = ZOStepper(model, "1.5spsa", run_seed=5, probes=2, eps=1e-3)
    rnd = st_f.probe_round(0, batch)
    be.submit(rnd)
    got = {r.seed: r for r in be.collect(rnd.round_id).results}
    ref = InProcessBackend(model, classifier_loss)
    ref.submit(rnd)
    for r in ref.collect(rnd.round_id).results:
        assert (got[r.seed].l_plus, got[r.seed].l_minus, got[r.seed].l0) == (r.l_plus, r.l_minus, r.l0)
    assert be.collect().results == []  # nothing arrived for the refused rounds
    be.close()
