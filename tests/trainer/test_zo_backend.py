"""InProcessBackend: probe values against hand-built perturbations; clean weights stay bit-identical."""

from __future__ import annotations

import pytest
import torch

from probe_kernels import direction, perturb
from support.quadratic import QuadraticModel, quad_loss
from trainer.zo import estimators as est
from trainer.zo.backend import InProcessBackend, collect_round
from trainer.zo.probes import ProbeKind, RoundSpec

SIZES = [6, 10, 3]


def _loss_at(model: QuadraticModel, flat: torch.Tensor) -> float:
    return float(0.5 * flat @ model.h @ flat + model.b @ flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probes_match_hand_built_perturbations_and_keep_weights(dtype):
    model = QuadraticModel(SIZES, seed=1, dtype=dtype)
    before = [p.detach().clone() for p in model.parameters()]
    be = InProcessBackend(model, quad_loss, history=2)
    be.publish(0)
    offsets = [0, 6, 16]
    eps = 1e-2
    seeded, _ = collect_round(be, RoundSpec("s", 0, None, eps, (5, 6), "gauss8", want_clean=True))
    for r in seeded:
        for sign, val in ((1, r.l_plus), (-1, r.l_minus)):
            flat = torch.cat([perturb(p.detach(), r.seed, o, sign * eps, "gauss8").double()
                              for p, o in zip(model.parameters(), offsets)])
            assert val == pytest.approx(_loss_at(model, flat), rel=1e-12)
        assert r.l0 == pytest.approx(_loss_at(model, model.theta()), rel=1e-12)
    blocked, _ = collect_round(be, RoundSpec("b", 0, None, eps, (7,), kind=ProbeKind.BLOCK_SCALED))
    z = est.block_scaled_direction(7, offsets, SIZES)
    flat = torch.cat([(p.detach().float() + eps * zi).to(dtype).double()
                      for p, zi in zip(model.parameters(), z.split(SIZES))])
    assert blocked[0].l_plus == pytest.approx(_loss_at(model, flat), rel=1e-6)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)  # bit-identical clean weights after all probes
    assert be.forward_passes == 1 + 4 + 2


def test_along_update_probes_use_the_published_step():
    model = QuadraticModel(SIZES, seed=2)
    be = InProcessBackend(model, quad_loss, history=2)
    be.publish(0)
    with torch.no_grad():
        model.p1.add_(torch.linspace(-1, 1, 10) * 1e-3)  # only block 1 moves
    be.publish(1)
    res, _ = collect_round(be, RoundSpec("l", 1, None, 1e-2, (0, 1, 2), want_clean=True,
                                       kind=ProbeKind.ALONG_UPDATE, base_version=0))
    assert res[0].scale == 0.0 and res[0].l_plus == res[0].l0 == res[0].l_minus
    u = torch.linspace(-1, 1, 10).double() * 1e-3
    assert res[1].scale == pytest.approx(float(u.norm() / 10**0.5), rel=1e-4)
    uhat = torch.zeros(19, dtype=torch.float64)
    uhat[6:16] = u / (u.norm() / 10**0.5)
    theta = model.theta()
    g = (res[1].l_plus - res[1].l_minus) / 2e-2
    assert g == pytest.approx(float(model.grad_at(theta) @ uhat), rel=1e-3)
    with pytest.raises(ValueError, match="history"):
        InProcessBackend(model, quad_loss).submit(
            RoundSpec("x", 1, None, 1e-2, (0,), kind=ProbeKind.ALONG_UPDATE, base_version=0))


def test_delayed_delivery_and_round_validation():
    model = QuadraticModel(SIZES, seed=3)
    be = InProcessBackend(model, quad_loss, delay_rounds=1)
    be.submit(RoundSpec("r0", 0, None, 1e-2, (1, 2)))
    assert be.collect().results == []
    be.submit(RoundSpec("r1", 1, None, 1e-2, (3,)))
    got = be.collect().results
    assert [(r.round_id, r.seed, r.version) for r in got] == [("r0", 1, 0), ("r0", 2, 0)]
    be.flush()
    assert [r.round_id for r in be.collect("r1").results] == ["r1"]
    with pytest.raises(RuntimeError, match="delay_rounds"):
        collect_round(be, RoundSpec("r2", 2, None, 1e-2, (4,)))
    with pytest.raises(ValueError):
        RoundSpec("bad", 0, None, 0.0, (1,))
    with pytest.raises(ValueError):
        RoundSpec("bad", 0, None, 1e-3, (1, 1))
    assert direction(1, 0, 4, "rademacher").abs().eq(1).all()


def test_in_process_intake_judges_stale_and_duplicate_like_the_coordinator():
    """The backend is the one authority: stale (older than latest − S) and redelivered (round, seed) results
    are counted and never handed out; the collector returns the rest with those counts."""
    model = QuadraticModel(SIZES, seed=4)
    be = InProcessBackend(model, quad_loss, delay_rounds=1, staleness=0)
    be.submit(RoundSpec("a", 0, None, 1e-2, (1, 2)))  # held back one round
    be.submit(RoundSpec("b", 1, None, 1e-2, (3,)))  # releases a, now one version old: stale
    be.submit(RoundSpec("b", 1, None, 1e-2, (3,)))  # a redelivery of b: releases b
    be.flush()  # releases the redelivered copy: duplicate
    got = be.collect()
    assert [(r.round_id, r.seed, r.version) for r in got.results] == [("b", 3, 1)]
    assert got.counts == {"accepted": 1, "stale": 2, "duplicate": 1, "dropped": 0, "retracted": 0}
    assert be.collect().counts["stale"] == 0  # counts are handed out once
    be2 = InProcessBackend(model, quad_loss)
    res, counts = collect_round(be2, RoundSpec("c", 2, None, 1e-2, (5, 4)))
    assert [r.seed for r in res] == [5, 4] and counts["accepted"] == 2
