"""A queue command that never reaches the worker's consumer (an add/cancel broadcast sent while the broker was away,
as during a Redis restart) is found and sent again: the worker trusts what its Celery consumer really consumes, not
what it asked for. Simulated end to end: a real coordinator and worker process, and a cancel_consumer broadcast the
worker did not send, so its consumer stops taking the run's queue while the worker believes it consumes it."""

from __future__ import annotations

import socket

import pytest

from coordinator.celery_app import make_celery
from support.fleet import REDIS_URL, Fleet, make_batch
from support.models import tiny_gpt2
from trainer.zo.probes import RoundSpec


def _log(fleet: Fleet, name: str) -> str:
    return (fleet.tmp / f"{name}.log").read_text(errors="replace")


@pytest.mark.slow
def test_a_lost_queue_command_is_sent_again_and_rounds_flow(tmp_path):
    fleet = Fleet(tmp_path)
    try:
        fleet.start_worker("a")
        worker_id = fleet.wait_consuming("a")
        be = fleet.backend(tiny_gpt2(n_embd=64), "resync", seeds_per_task=2)
        be.publish(0)
        queue = f"{fleet.prefix}.probe.resync"
        fleet.wait(lambda: f"Started consuming from {queue}" in _log(fleet, "a"), "the run's queue consumed")

        app = make_celery(REDIS_URL)
        host = socket.gethostname()[:64] or "unknown"
        app.control.cancel_consumer(queue, destination=[f"{worker_id}@{host}"], reply=False)  # not the worker's own
        fleet.wait(lambda: f"Canceling queue {queue}" in _log(fleet, "a"), "the consumer cancelled")
        fleet.wait(lambda: "a queue command was lost" in _log(fleet, "a"), "the difference found", timeout_s=60)
        fleet.wait(lambda: _log(fleet, "a").count(f"Started consuming from {queue}") == 2, "the queue taken again",
                   timeout_s=60)

        rnd = RoundSpec("r0", 0, make_batch(4, 16, seed=1), eps=1e-2, seeds=tuple(range(8)), distribution="rademacher")
        be.submit(rnd)
        got = be.collect(rnd.round_id).results
        assert sorted(r.seed for r in got) == list(range(8))  # the round is evaluated: the queue flows again
        be.close()
        app.close()
    finally:
        fleet.close()
