"""benchmarks.fleet_gpu on the CPU (its GPU run is `sparecycles bench fleet --trainer-device cuda:N`): the loss
comparison finds in-process evaluation equal to itself bit for bit, and the trainer-cost loop publishes
zocurv-line's two versions per interval, in order, and reports the training it timed."""

from __future__ import annotations

import torch

from benchmarks.fleet_gpu import compare_losses, trainer_cost
from support.models import tiny_gpt2
from trainer.batch_losses import loss_for_kind
from trainer.zo.backend import InProcessBackend
from trainer.zo.probes import RoundSpec


def _batch(seed: int = 0):
    t = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def test_compare_losses_of_in_process_results_are_bit_equal():
    model, loss = tiny_gpt2(vocab_size=96, n_positions=32), loss_for_kind("lm")
    be = InProcessBackend(model, loss)
    be.submit(RoundSpec("r", 0, _batch(), 1e-3, (5, 3, 9), "rademacher"))
    got = compare_losses(be.collect("r").results, model, _batch(), loss, 1e-3, "rademacher", "cpu", seeds=2)
    assert got["seeds"] == 2
    for key in ("in_process_reference", "in_process_fast_path"):
        assert got[key]["values"] == got[key]["bit_equal"] == 4 and got[key]["max_abs"] == 0.0


class _Recorder:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, version: int) -> None:
        self.versions.append(version)


def test_trainer_cost_publishes_two_versions_per_interval_in_order():
    model = tiny_gpt2(vocab_size=96, n_positions=32)
    before = [p.detach().clone() for p in model.parameters()]
    rec = _Recorder()
    got = trainer_cost(rec, model, _batch(1), loss_for_kind("lm"), interval=3, repeats=2, first_version=7)
    assert rec.versions == [7, 8, 9, 10]
    assert len(got["interval_s"]) == len(got["interval_with_publish_s"]) == 2 and len(got["publish_call_s"]) == 4
    assert got["cost_fraction"] == got["cost_per_version_s"] / sorted(got["interval_s"])[1]
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it trained
