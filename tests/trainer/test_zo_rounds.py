"""RoundBook, the round lifecycle: which refresh folds a round under each timing, the staleness bound on rounds,
counters, and the rounds in flight through a checkpoint. Rounds run on a quadratic in process (InProcessBackend,
optionally delivering late)."""

from __future__ import annotations

import pytest
import torch

from support.quadratic import QuadraticModel, quad_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import ProbeKind, RoundSpec
from trainer.zo.rounds import RoundBook

SIZES = [6, 10, 3]


def _round(v: int, batch=None) -> RoundSpec:
    return RoundSpec(f"r-{v}", v, batch, 1e-2, (1, 2), "rademacher", want_clean=True, kind=ProbeKind.BLOCK_SCALED)


def _refresh(book: RoundBook, be, v: int, batch=None) -> list[str]:
    book.issue(be, [_round(v, batch)])
    book.collect(be)
    return [r.round_id for done in book.due(v) for r, _ in done]


@pytest.mark.parametrize("timing,folded", [("async", [["r-0"], ["r-1"], ["r-2"]]),
                                           ("sync", [["r-0"], ["r-1"], ["r-2"]]),
                                           ("next", [[], ["r-0"], ["r-1"]])])
def test_each_timing_folds_at_its_refresh(timing, folded):
    be = InProcessBackend(QuadraticModel(SIZES, seed=1), quad_loss)
    book = RoundBook(2, timing)
    assert [_refresh(book, be, v) for v in range(3)] == folded
    taken = 6 if timing != "next" else 4  # "next" has not taken the newest round's results yet
    assert book.counts == {"accepted": taken, "stale": 0, "duplicate": 0}
    assert [r.round_id for r in book.inflight()] == ([] if timing != "next" else ["r-2"])


def test_next_leaves_every_round_of_the_newest_refresh_to_the_next():
    """Under "next" a refresh of several rounds (zocurv-group, -trust) is not waited for at its own refresh, not even
    in part: with a backend that holds results until asked (delay) none of them is taken there; all fold at the
    next refresh, after `before_publish` waited for them."""
    be = InProcessBackend(QuadraticModel(SIZES, seed=4), quad_loss, delay_rounds=3)
    book = RoundBook(2, "next", timeout_s=0.0)
    waited = []
    collect = be.collect

    def spy(round_id=None, timeout_s=0.0, counts=False):
        waited.append(round_id)
        return collect(round_id, timeout_s, counts)

    be.collect = spy
    rounds = [RoundSpec(f"r-0-{i}", 0, None, 1e-2, (1, 2), want_clean=True, kind=ProbeKind.BLOCK_SCALED)
              for i in range(3)]
    book.issue(be, rounds)
    book.collect(be)
    assert waited == [] and book.due(0) == [] and len(book.inflight()) == 3
    be.flush()  # the held results arrive (the fleet answering meanwhile)
    book.before_publish(be, 1)
    assert waited == ["r-0-0", "r-0-1", "r-0-2"]
    assert [r.round_id for done in book.due(1) for r, _ in done] == ["r-0-0", "r-0-1", "r-0-2"]


def test_a_round_stale_before_completing_is_dropped_and_its_late_results_counted_stale():
    """Results arrive two refreshes late; with S = 1 every round is older than latest − S when its results come:
    the backend's authority refuses them (stale) and the book drops each round once it is stale (3 of 5 by v = 4;
    wire.staleness.is_stale, the rule the coordinator's intake applies)."""
    be = InProcessBackend(QuadraticModel(SIZES, seed=2), quad_loss, delay_rounds=2, staleness=1)
    book = RoundBook(1)
    assert [_refresh(book, be, v) for v in range(5)] == [[]] * 5
    assert book.dropped == 3 and book.counts["stale"] == 6 and book.counts["accepted"] == 0
    assert book.stats("curv")["curv_dropped_rounds"] == 3 and book.stats("curv")["curv_pending_rounds"] == 2
    with pytest.raises(ValueError):
        RoundBook(-1)
    with pytest.raises(ValueError):
        RoundBook(2, "later")


def test_rounds_in_flight_survive_a_checkpoint():
    x = (torch.arange(6).view(2, 3),)
    be = InProcessBackend(QuadraticModel(SIZES, seed=3), quad_loss)
    book = RoundBook(2, "next")
    _refresh(book, be, 0, x)
    tensors, meta = book.state()
    assert torch.equal(tensors["round/0/batch/0"], x[0]) and meta["inflight"][0]["round_id"] == "r-0"
    other = RoundBook(2, "next")
    other.load_state(tensors, meta)
    assert other.inflight() == book.inflight() and other.counts == book.counts
    other.drop_inflight()
    assert other.inflight() == [] and other.dropped == 1
    meta["inflight"][0]["batch_len"] = None  # a batch that was not tensors: the round cannot be re-issued
    other.load_state(tensors, meta)
    assert other.inflight() == [] and other.dropped == 1
