"""trainer.zo.probes: the one table of probe kinds, the group kind on a quadratic, and its wire validation."""

from __future__ import annotations

from typing import get_args

import pydantic
import pytest
import torch

from probe_kernels import direction
from support.quadratic import QuadraticModel, quad_loss
from trainer.zo import probes
from trainer.zo.backend import InProcessBackend, collect_round
from trainer.zo.probes import KINDS, ProbeKind, RoundSpec
from wire.messages import ProbeKindName
from wire.round_messages import ProbeRound, ProbeTask

SIZES = [6, 10, 4, 5]
OFFSETS = [0, 6, 16, 20]


def test_kind_table_wire_names_and_offsets_are_one():
    assert {k.value for k in KINDS} == set(get_args(ProbeKindName)) == {k.value for k in ProbeKind}
    model = QuadraticModel(SIZES, seed=1)
    assert [b.offset for b in probes.canonical_blocks(model)] == OFFSETS
    assert probes.block_sizes(probes.canonical_blocks(model)) == SIZES


@pytest.mark.parametrize("dist", ["rademacher", "gauss8"])
def test_group_probe_measures_the_groups_curvature_on_a_quadratic(dist):
    """h = (L+ + L- - 2 L0)/eps^2 = z_G^T H_GG z_G exactly for a quadratic, z_G = z(seed) on the group's blocks."""
    model = QuadraticModel(SIZES, seed=2)  # fp32 weights; the loss is float64 (exact up to weight rounding)
    be = InProcessBackend(model, quad_loss)
    group, eps = (1, 3), 1e-1
    idx = torch.cat([torch.arange(OFFSETS[b], OFFSETS[b] + SIZES[b]) for b in group])
    seeds = tuple(range(40, 48))
    res, _ = collect_round(be, RoundSpec("g", 0, None, eps, seeds, dist, want_clean=True, kind=ProbeKind.GROUP,
                                         blocks=group))
    h_sub = model.h[idx][:, idx]
    for r in res:
        z = torch.cat([direction(r.seed, OFFSETS[b], SIZES[b], dist).double() for b in group])
        h = (r.l_plus + r.l_minus - 2 * r.l0) / eps**2
        assert h == pytest.approx(float(z @ h_sub @ z), rel=1e-4)
        g = (r.l_plus - r.l_minus) / (2 * eps)
        assert g == pytest.approx(float(model.grad_at(model.theta())[idx] @ z), rel=1e-4, abs=1e-4)
    # the per-group curvature estimate tr(H_GG)/n_G is the mean of h/n_G; E[z zᵀ] = I for both dists
    assert {r.seed for r in res} == set(seeds)


def test_group_leaves_other_blocks_and_clean_weights_alone():
    model = QuadraticModel(SIZES, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    blocks = probes.canonical_blocks(model)
    new = probes.group_weights(blocks, (0, 2), seed=9, alpha=1e-2, dist="gauss8")
    assert sorted(new) == [0, 2]
    torch.testing.assert_close(new[2].double(), (before[2].double() + 1e-2 * direction(9, 16, 4, "gauss8").double()),
                               rtol=0, atol=1e-6)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_group_rounds_are_validated_on_both_sides():
    for bad in [(), (2, 1), (1, 1), (-1, 2)]:
        with pytest.raises(ValueError):
            RoundSpec("g", 0, None, 1e-2, (1,), kind=ProbeKind.GROUP, blocks=bad)
    with pytest.raises(ValueError, match="only meaningful"):
        RoundSpec("s", 0, None, 1e-2, (1,), blocks=(0,))
    be = InProcessBackend(QuadraticModel(SIZES, seed=4), quad_loss)
    with pytest.raises(ValueError, match="out of range"):
        be.submit(RoundSpec("g", 0, None, 1e-2, (1,), kind=ProbeKind.GROUP, blocks=(0, 4)))
    wire = {"run": "r", "round_id": "g-0", "version": 0, "batch_sha256": "0" * 64, "eps": 1e-2,
            "distribution": "gauss8", "seeds": [1], "kind": "group"}
    ok = ProbeRound(schema_version=2, blocks=[0, 3], **wire)
    task = ProbeTask(schema_version=2, blocks=[0, 3], want_clean=False,
                     **{k: v for k, v in wire.items() if k != "seeds"}, seeds=[1])
    assert ok.blocks == task.blocks == [0, 3]
    assert ProbeRound.model_validate_json(ok.model_dump_json()) == ok
    for kw in [{"schema_version": 1, "blocks": [0]},  # group needs schema 2
               {"schema_version": 2, "blocks": [3, 0]}, {"schema_version": 2, "blocks": [0, 0]},
               {"schema_version": 2, "blocks": []}, {"schema_version": 2}]:
        with pytest.raises(pydantic.ValidationError):
            ProbeRound(**kw, **wire)
    with pytest.raises(pydantic.ValidationError):
        ProbeRound(schema_version=2, blocks=[0], **{**wire, "kind": "seeded"})


def test_round_spec_names_its_fields_as_the_wire_does():
    import dataclasses

    from wire.round_messages import ProbeRound

    spec = RoundSpec("g-1", 3, None, 1e-2, (4, 2), "gauss8", want_clean=True, kind=ProbeKind.GROUP, blocks=(0, 5))
    wire = spec.to_wire("r", "b" * 64)
    trainer_only, wire_only = {"batch"}, {"run", "batch_sha256", "schema_version"}
    names = {f.name for f in dataclasses.fields(RoundSpec)}
    assert names - trainer_only == set(ProbeRound.model_fields) - wire_only
    assert {n: getattr(wire, n) for n in names - trainer_only} == {
        "round_id": "g-1", "version": 3, "eps": 1e-2, "seeds": [4, 2], "distribution": "gauss8", "want_clean": True,
        "kind": "group", "base_version": None, "blocks": [0, 5], "slices": None, "eval": None}
    sliced = RoundSpec("g-2", 3, None, 1e-2, (4,), kind=ProbeKind.GROUP, blocks=(0, 5), slices=((5, 1, 0, 8),))
    assert sliced.to_wire("r", "b" * 64).slices == [[5, 1, 0, 8]]
    with pytest.raises(ValueError, match="slices"):  # a slice of a block outside the group
        RoundSpec("g-3", 3, None, 1e-2, (4,), kind=ProbeKind.GROUP, blocks=(0,), slices=((5, 1, 0, 8),))
    with pytest.raises(pydantic.ValidationError):
        sliced.to_wire("r", "b" * 64).model_copy(update={}).model_validate(
            {**sliced.to_wire("r", "b" * 64).model_dump(), "slices": [[5, 1, 8, 8]]})  # empty slice
    assert wire.schema_version == 2 and RoundSpec("s", 0, None, 1e-2, (1,)).to_wire("r", "b" * 64).schema_version == 1
