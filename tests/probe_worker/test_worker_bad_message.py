"""A malformed item on a probe queue (anyone with the broker ACL may LPUSH one) is dropped and counted; the
real worker process keeps consuming and evaluates the next valid task. Real Redis, coordinator and worker."""

from __future__ import annotations

import json

import pytest

from probe_worker.broker import envelope_problem
from support.fleet import Fleet, make_batch
from support.models import tiny_gpt2
from trainer.zo.probes import RoundSpec

pytestmark = pytest.mark.slow  # a coordinator process and a probe-worker process

BAD_ITEMS = {
    "not json at all": "undecodable",
    "\xff\xfe": "undecodable",
    "[1, 2]": "not_envelope",
    json.dumps({"body": "eA=="}): "not_envelope",  # no properties
    json.dumps({"properties": {"delivery_tag": "t"}}): "not_envelope",  # no body
}


def test_envelope_problem_by_kind():
    """Only a JSON object with a string body and delivery tag/info passes."""
    good = {"body": "e30=", "properties": {"delivery_tag": "t", "delivery_info": {"exchange": "", "routing_key": "q"}}}
    assert envelope_problem(good) is None
    for bad in ([1], "x", None, {"body": "x"}, {**good, "body": None},
                {**good, "properties": {"delivery_tag": "t"}}):
        assert envelope_problem(bad) is not None


def test_worker_survives_malformed_queue_items(tmp_path):
    fleet = Fleet(tmp_path)
    try:
        fleet.start_worker("a")
        fleet.wait_consuming("a")
        be = fleet.backend(tiny_gpt2(), "bad")
        be.publish(0)
        queue = f"{fleet.prefix}.probe.bad"
        for item in BAD_ITEMS:  # LPUSH + BRPOP is FIFO: the worker meets every bad item before the round
            fleet.r.lpush(queue, item)
        seeds = tuple(range(3000, 3004))
        be.submit(RoundSpec("bad-0", 0, make_batch(2, 8, seed=3), eps=1e-2, seeds=seeds, distribution="gauss8"))
        assert {r.seed for r in be.collect("bad-0").results} == set(seeds)
        assert fleet.workers["a"].poll() is None
        for reason in ("undecodable", "not_envelope"):
            want = sum(r == reason for r in BAD_ITEMS.values())
            got = fleet.metric("a", f'sparecycles_worker_rejected_messages_total{{reason="{reason}"}}')
            assert got == want, reason
        assert fleet.metric("a", "sparecycles_worker_probes_evaluated_total") == len(seeds)
        be.close()
    finally:
        fleet.close()
