"""Contract tests of the wire messages and settings, plus the no-torch import guarantee."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.settings import CoordinatorSettings, generate_dev_settings
from coordinator.store import spot_check_selected
from wire.messages import MAX_SEEDS_PER_TASK, RunSpec, SeedLedgerEntry, VersionManifest
from wire.round_messages import (
    MAX_LINE_SEED,
    MAX_LINE_STEP,
    ProbeResult,
    ProbeRound,
    ProbeTask,
    ResultBatch,
    StreamEvent,
    line_multiple,
    line_seed,
    values_agree,
)

WID = "w-0123456789abcdef"
SHA = "a" * 64


def res(**kw):
    base = {
        "run": "r",
        "round_id": "k",
        "seed": 1,
        "version": 0,
        "worker_id": WID,
        "l_plus": 1.0,
        "l_minus": 2.0,
    }
    base.update(kw)
    return base


def test_result_roundtrip_and_strictness():
    r = ProbeResult.model_validate(res(seed=2**64 - 1, l0=0.5))
    assert ProbeResult.model_validate_json(r.model_dump_json()) == r
    assert r.schema_version == 1
    for bad in [
        res(seed=2**64),
        res(seed=-1),
        res(seed="5"),
        res(l_plus=float("nan")),
        res(l_minus=float("inf")),
        res(extra=1),
        res(worker_id="w-XYZ"),
        res(run="Bad Run"),
        res(schema_version=2),
        res(replica=3),
        res(l_plus="1.0"),
    ]:
        with pytest.raises(ValidationError):
            ProbeResult.model_validate(bad)
    with pytest.raises(ValidationError):  # JSON NaN literal
        ProbeResult.model_validate_json(json.dumps(res()).replace("1.0", "NaN"))
    with pytest.raises(ValidationError):  # frozen
        r.seed = 3  # type: ignore[misc]


def test_bounded_lists_and_cross_field_rules():
    rnd = {
        "run": "r",
        "round_id": "k",
        "version": 0,
        "batch_sha256": SHA,
        "eps": 1e-3,
        "distribution": "gauss8",
        "seeds": [1, 2],
    }
    ProbeRound.model_validate(rnd)
    with pytest.raises(ValidationError, match="unique"):
        ProbeRound.model_validate(dict(rnd, seeds=[1, 1]))
    with pytest.raises(ValidationError):
        ProbeRound.model_validate(dict(rnd, distribution="uniform"))
    with pytest.raises(ValidationError):
        ProbeRound.model_validate(dict(rnd, eps=0.0))
    assert (
        ProbeRound.model_validate(dict(rnd, version=3, kind="along_update", base_version=2)).base_version == 2
    )
    for bad in [{"kind": "along_update"}, {"kind": "along_update", "base_version": 0}, {"base_version": 0}]:
        with pytest.raises(ValidationError, match="base_version"):
            ProbeRound.model_validate(dict(rnd, **bad))
    task = dict(rnd, want_clean=False, seeds=list(range(MAX_SEEDS_PER_TASK + 1)))
    with pytest.raises(ValidationError):
        ProbeTask.model_validate(task)
    with pytest.raises(ValidationError):
        ResultBatch.model_validate({"results": []})
    led = {
        "run": "r",
        "version": 3,
        "parent": 2,
        "seeds": [1, 2],
        "coeffs": [0.5, 0.25],
        "distribution": "rademacher",
    }
    assert SeedLedgerEntry.model_validate(led).scale == 1.0
    with pytest.raises(ValidationError, match="same length"):
        SeedLedgerEntry.model_validate(dict(led, coeffs=[0.5]))
    with pytest.raises(ValidationError, match="exactly one version"):
        SeedLedgerEntry.model_validate(dict(led, parent=1))
    shard = {"name": "a.safetensors", "sha256": SHA, "bytes": 3}
    man = {
        "run": "r",
        "version": 1,
        "parent": 0,
        "shards": [shard],
        "param_order_hash": SHA,
        "dtype": "bfloat16",
        "model_class": "GPT2LMHeadModel",
    }
    VersionManifest.model_validate(man)
    with pytest.raises(ValidationError, match="unique"):
        VersionManifest.model_validate(dict(man, shards=[shard, shard]))
    with pytest.raises(ValidationError, match="older"):
        VersionManifest.model_validate(dict(man, parent=1))
    with pytest.raises(ValidationError):
        VersionManifest.model_validate(dict(man, shards=[dict(shard, name="../etc/passwd")]))
    ev = StreamEvent(kind="accepted", run="r", round_id="k", seed=1, result=ProbeResult.model_validate(res()))
    assert StreamEvent.model_validate_json(ev.model_dump_json()) == ev


def test_values_agree_is_the_symmetric_tolerance_rule():
    a = ProbeResult.model_validate(res(l_plus=100.0, l_minus=1.0, l0=5.0))
    b = ProbeResult.model_validate(res(l_plus=100.0 + 1e-3, l_minus=1.0, l0=5.0))
    assert values_agree(a, b, rtol=1e-5, atol=0.0)  # 1e-3 <= 1e-5 * 100.001
    assert not values_agree(a, b, rtol=1e-6, atol=0.0)
    assert values_agree(a, b, rtol=0.0, atol=1e-3 + 1e-12)
    c = ProbeResult.model_validate(res(l_plus=100.0, l_minus=1.0, l0=6.0))
    assert not values_agree(a, c, rtol=1e-5, atol=0.0)  # l0 compared when both have it
    d = ProbeResult.model_validate(res(l_plus=100.0, l_minus=1.0))
    assert values_agree(c, d, rtol=0.0, atol=0.0)


@hsettings(max_examples=50, deadline=None)
@given(st.floats(0.0, 1.0), st.text(alphabet="abc-", min_size=1, max_size=8))
def test_spot_check_selection_is_deterministic_and_proportional(fraction, rid):
    seeds = range(4000)
    chosen = [s for s in seeds if spot_check_selected("run", rid, s, fraction)]
    assert chosen == [s for s in seeds if spot_check_selected("run", rid, s, fraction)]
    # binomial(4000, f): 6 standard deviations either way (the hash is a fixed function, no flakiness)
    sd = math.sqrt(4000 * fraction * (1 - fraction))
    assert abs(len(chosen) - 4000 * fraction) <= 6 * sd + 1
    if fraction == 0.0:
        assert chosen == []


def test_settings_refuse_default_and_short_secrets(monkeypatch):
    for admin, enroll in [
        ("changethis", "x" * 32),
        ("", "y" * 32),
        ("short", "y" * 32),
        ("z" * 32, "z" * 32),
    ]:
        with pytest.raises(ValidationError):
            CoordinatorSettings(admin_token=admin, enrollment_token=enroll)
    CoordinatorSettings(admin_token="changethis", enrollment_token="changethis", dev_mode=True)
    monkeypatch.setenv("SPARECYCLES_ADMIN_TOKEN", "changethis")
    monkeypatch.setenv("SPARECYCLES_ENROLLMENT_TOKEN", "e" * 20)
    with pytest.raises(ValidationError, match="admin_token"):
        CoordinatorSettings()
    monkeypatch.setenv("SPARECYCLES_ADMIN_TOKEN", "a" * 20)
    monkeypatch.setenv("REDIS_URL", "redis://:pw@example:6380/2")
    s = CoordinatorSettings()
    assert s.redis_url == "redis://:pw@example:6380/2" and s.worker_broker_url == s.redis_url
    a, b = generate_dev_settings(), generate_dev_settings()
    assert a.admin_token != b.admin_token and len(a.admin_token.get_secret_value()) >= 32
    assert not a.dev_mode
    with pytest.raises(ValidationError, match="heartbeat"):
        generate_dev_settings(lease_seconds=1.0, heartbeat_interval_s=2.0)


def test_api_and_coordinator_do_not_import_torch():
    code = (
        "import sys; import api.app, api.cli, benchmarks.cli, coordinator.stream, coordinator.intake; "
        "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; print(bad); "
        "sys.exit(1 if 'torch' in bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_line_rounds_and_tasks_bound_their_step_multiples():
    line = {"run": "r", "round_id": "k", "version": 50, "batch_sha256": SHA, "eps": 0.5, "distribution": "gauss8",
            "seeds": [1, 2, 3], "kind": "line", "base_version": 0, "want_clean": False}
    assert ProbeRound.model_validate(line).seeds == [1, 2, 3]
    assert ProbeTask.model_validate(dict(line, seeds=[MAX_LINE_SEED], eps=MAX_LINE_STEP / MAX_LINE_SEED)).seeds == [64]
    for bad, why in [({"seeds": [0, 1]}, "step multiples"), ({"seeds": [MAX_LINE_SEED + 1]}, "step multiples"),
                     ({"seeds": [40], "eps": 0.5}, "j\\*eps = 20")]:
        for model in (ProbeRound, ProbeTask):
            with pytest.raises(ValidationError, match=why):
                model.model_validate(dict(line, **bad))
    assert ProbeRound.model_validate(dict(line, kind="seeded", base_version=None, seeds=[0], eps=1.0)).seeds == [0]
    from trainer.zo.probes import RoundSpec  # the trainer refuses what the wire would (torch: imported here)

    fields = {"round_id": "k", "version": 50, "batch": None, "eps": 0.5, "seeds": (0, 1), "kind": "line",
              "base_version": 0}
    with pytest.raises(ValueError, match="step multiples"):
        RoundSpec(**fields)


def test_group_line_rounds_name_their_segments_and_one_point_per_seed():
    """A group_line round: a role's segments as blocks + slices (schema 2), θ_base, one signed step multiple per
    seed (zigzag); the wire refuses what a worker could not evaluate, naming why, and so does the trainer."""
    assert [line_multiple(s) for s in (1, 2, 3, 4)] == [-1, 1, -2, 2]
    assert all(line_multiple(line_seed(k)) == k for k in range(-70, 71))
    gl = {"schema_version": 2, "run": "r", "round_id": "k", "version": 6, "batch_sha256": SHA, "eps": 0.5,
          "distribution": "rademacher", "seeds": [1, 2, 4], "kind": "group_line", "base_version": 3, "want_clean": True,
          "blocks": [1, 4], "slices": [[4, 1, 0, 64]]}
    rnd = ProbeRound.model_validate(gl)
    (task,) = ProbeTask.split(rnd, rnd.seeds, replica=0, per_task=8)
    assert (task.blocks, task.slices, task.base_version) == ([1, 4], [[4, 1, 0, 64]], 3)
    for bad, why in [({"seeds": [0, 1]}, "seed 0 is the clean loss"), ({"seeds": [line_seed(65)]}, "<= 64"),
                     ({"seeds": [line_seed(-40)]}, "\\|k\\|\\*eps = 20"), ({"base_version": None}, "need base_version"),
                     ({"base_version": 6}, "base_version < version"), ({"blocks": None, "slices": None}, "`blocks`"),
                     ({"schema_version": 1}, "schema_version 2"), ({"slices": [[2, 1, 0, 64]]}, "distinct blocks")]:
        for model in (ProbeRound, ProbeTask):
            with pytest.raises(ValidationError, match=why):
                model.model_validate(dict(gl, **bad))
    from trainer.zo.probes import ProbeKind, RoundSpec  # the trainer refuses what the wire would

    with pytest.raises(ValueError, match="seed 0 is the clean loss"):
        RoundSpec("k", 6, None, 0.5, (0, 1), kind=ProbeKind.GROUP_LINE, base_version=3, blocks=(1,))
    with pytest.raises(ValueError, match="needs at least one block index"):
        RoundSpec("k", 6, None, 0.5, (1,), kind=ProbeKind.GROUP_LINE, base_version=3)
    assert RoundSpec("k", 6, None, 0.5, (1, 2, 4), want_clean=True, kind=ProbeKind.GROUP_LINE, base_version=3,
                     blocks=(1, 4), slices=((4, 1, 0, 64),)).to_wire("r", SHA) == rnd


@pytest.mark.parametrize("extra", [{}, {"schema_version": 2, "kind": "group", "blocks": [0, 3]},
                                   {"schema_version": 2, "kind": "group_line", "blocks": [0, 3], "base_version": 1,
                                    "slices": [[3, 0, 0, 2]], "seeds": [1, 2, 4, 3, 6], "eps": 0.5},
                                   {"kind": "line", "base_version": 1, "seeds": [1, 2, 3, 4, 5], "eps": 0.5}])
def test_tasks_carry_every_field_of_their_round(extra):
    rnd = ProbeRound.model_validate({"run": "r", "round_id": "k", "version": 7, "batch_sha256": SHA, "eps": 1e-3,
                                     "distribution": "gauss8", "seeds": [9, 4, 1, 6, 5], "want_clean": True, **extra})
    tasks = ProbeTask.split(rnd, rnd.seeds, replica=1, per_task=2)
    assert [t.seeds for t in tasks] == [rnd.seeds[0:2], rnd.seeds[2:4], rnd.seeds[4:]]
    for t in tasks:
        assert t.model_dump(exclude={"seeds", "replica"}) == rnd.model_dump(exclude={"seeds"}) and t.replica == 1
        assert ("blocks" in t.model_dump_json()) == ("blocks" in extra)  # schema 1 stays byte-identical
    shared = set(ProbeRound.model_fields)
    assert shared <= set(ProbeTask.model_fields) and set(ProbeTask.model_fields) - shared == {"replica"}


def test_each_setting_has_one_bound_shared_by_wire_and_trainer_config():
    from wire.bounds import MAX_PROBE_EPS, MAX_STALENESS, RUN_SEED_LIMIT

    rnd = {"run": "r", "round_id": "k", "version": 1, "batch_sha256": SHA, "distribution": "gauss8", "seeds": [1]}
    spec = {"run": "r", "model_class": "m"}
    assert ProbeRound.model_validate(dict(rnd, eps=MAX_PROBE_EPS)).eps == MAX_PROBE_EPS
    assert RunSpec.model_validate(dict(spec, staleness=MAX_STALENESS)).staleness == MAX_STALENESS
    for model, body in [(ProbeRound, dict(rnd, eps=MAX_PROBE_EPS * 1.01)), (ProbeRound, dict(rnd, eps=math.inf)),
                        (RunSpec, dict(spec, staleness=MAX_STALENESS + 1)), (RunSpec, dict(spec, staleness=-1))]:
        with pytest.raises(ValidationError):
            model.model_validate(body)
    from trainer.config import TrainConfig  # the same bounds, the trainer's side (torch: imported here)

    assert TrainConfig(eps=MAX_PROBE_EPS, staleness=MAX_STALENESS, seed=RUN_SEED_LIMIT - 1).eps == MAX_PROBE_EPS
    for bad in [{"eps": MAX_PROBE_EPS * 1.01}, {"staleness": MAX_STALENESS + 1}, {"seed": RUN_SEED_LIMIT}]:
        with pytest.raises(ValidationError):
            TrainConfig(**bad)
