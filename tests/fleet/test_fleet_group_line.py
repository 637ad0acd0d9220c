"""The ``group_line`` probe kind on a real fleet: a coordinator process on real Redis and one probe-worker process
(support.fleet), the trainer side through CoordinatorBackend. A refresh's rounds (one per held-out batch and role,
GPT-2's QK/V columns of c_attn as slices) give, bit for bit, the losses `group_line_losses` computes in process, and
the in-process backend's; rounds that do not fit the model or the wire are refused and counted where they arrive;
zocurv-trust trained on the fleet at `up`'s timing folds each refresh at the next and resumes bit for bit."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import torch
from safetensors import safe_open

from fleet.attach import Fleet, FleetStatus
from support.events import metrics_records
from support.fleet import make_batch
from support.models import tiny_gpt2
from support.resume import assert_same_checkpoints
from trainer.config import TrainConfig
from trainer.models.losses import lm_batch_loss
from trainer.train import TrainHooks, train
from trainer.zo.backend import InProcessBackend
from trainer.zo.group_line import DESIGN_EPS, group_line_losses, group_line_rounds, group_line_table
from trainer.zo.groups import model_roles
from trainer.zo.modes import ZOCurvMode
from trainer.zo.probes import ProbeFitError, ProbeKind, RoundSpec
from trainer.zo.trust_region import DESIGN_ALPHAS
from wire import batch as batch_wire
from wire.round_messages import line_seed

pytestmark = pytest.mark.slow  # a coordinator process and a probe-worker process


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from support.fleet import one_worker as fleet_of_one

    with fleet_of_one(tmp_path_factory.mktemp("fleet_group_line")) as got:
        yield got


def _displace(model: torch.nn.Module) -> list[torch.Tensor]:
    """Move every weight by a deterministic step (half its mean magnitude: big enough that QK moves the loss at
    GPT-2 init); return θ_prev (fp32 copies from before)."""
    prev = [p.detach().float().clone() for p in model.parameters()]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(100 + i)
            p.add_(0.5 * torch.randn(p.shape, generator=g) * (p.detach().abs().mean() + 1e-3))
    return prev


def _run(backend, rounds: list[RoundSpec]) -> list:
    for r in rounds:
        backend.submit(r)
    out = []
    for r in rounds:
        got = {x.seed: x for x in backend.collect(r.round_id, timeout_s=120.0).results}
        assert set(got) == set(r.seeds), r.round_id
        out.append((r, [got[s] for s in r.seeds]))
    return out


def test_fleet_group_line_losses_equal_in_process(one_worker):
    procs, _ = one_worker
    model = tiny_gpt2()
    gmap = model_roles(model)
    be = procs.backend(model, "gline")
    local = InProcessBackend(model, lm_batch_loss, history=2)
    be.publish(0)
    local.publish(0)
    prev = _displace(model)
    be.publish(1)
    local.publish(1)
    batches = [make_batch(2, 16, seed=b) for b in range(3)]
    rounds = group_line_rounds(gmap, batches, 1, 0, DESIGN_ALPHAS)
    assert len(rounds) == 3 * len(gmap.roles) and rounds[0].seeds == (line_seed(-1), line_seed(1), line_seed(2))
    qk = next(r for r in rounds if r.round_id.endswith("-qk"))
    assert qk.slices and all(sl[1:] == (1, 0, 64) or sl[1:] == (0, 0, 64) for sl in qk.slices)  # c_attn [0, 2D)

    fleet_table = group_line_table(_run(be, rounds), DESIGN_ALPHAS)
    local_table = group_line_table(_run(local, rounds), DESIGN_ALPHAS)
    want, fwd = group_line_losses(model, lm_batch_loss, batches, gmap, prev, DESIGN_ALPHAS)
    assert fwd == 3 * (1 + len(gmap.roles) * (len(DESIGN_ALPHAS) - 1))
    assert set(fleet_table) == set(want) == set(gmap.roles)
    for role in gmap.roles:
        assert fleet_table[role].shape == (3, len(DESIGN_ALPHAS))
        assert torch.equal(fleet_table[role], want[role]), role  # bit for bit
        assert torch.equal(local_table[role], want[role]), role
        assert len(set(want[role][0].tolist())) == len(DESIGN_ALPHAS), role  # every point really moved the loss
    assert be.collect().results == []  # nothing delivered twice
    be.close()


def test_rounds_that_do_not_fit_are_refused_and_counted(one_worker):
    procs, _ = one_worker
    model = tiny_gpt2()
    be = procs.backend(model, "gline-bad")
    be.publish(0)
    _displace(model)
    be.publish(1)
    batch = make_batch(2, 16, seed=7)
    # c_attn.weight is (32, 96): a slice to column 200 is well-formed on the wire but outside the block
    c_attn = [i for i, (n, _) in enumerate(model.named_parameters()) if n.endswith("0.attn.c_attn.weight")][0]
    bad = RoundSpec("gl-bad", 1, batch, DESIGN_EPS, (line_seed(1),), kind=ProbeKind.GROUP_LINE, base_version=0,
                    blocks=(c_attn,), slices=((c_attn, 1, 0, 200),))
    with pytest.raises(ProbeFitError, match="outside block"):
        be.submit(bad)  # the trainer refuses it first
    blob = batch_wire.encode_batch(batch, "lm")
    invalid0 = _tasks(procs, "invalid")
    be.submit_wire(bad.to_wire(be.run, hashlib.sha256(blob).hexdigest()), blob)  # a trainer that did not check
    procs.wait(lambda: _tasks(procs, "invalid") > invalid0, "the worker's invalid count")
    # the coordinator refuses what the wire forbids, naming it, and counts it
    body = bad.to_wire(be.run, hashlib.sha256(blob).hexdigest()).model_dump(mode="json")
    for change, why in [({"seeds": [0]}, "seed 0 is the clean loss"), ({"base_version": None}, "need base_version"),
                        ({"blocks": None, "slices": None}, "non-empty `blocks`")]:
        r = procs.admin.post(f"/v1/runs/{be.run}/rounds", json={**body, "round_id": "gl-wire", **change})
        assert r.status_code == 422 and why in r.text, r.text
    assert _coordinator_metric(procs, 'sparecycles_rejected_requests_total{reason="validation"}') >= 3
    be.close()


def _tasks(procs, outcome: str) -> float:
    try:
        return procs.metric("a", f'sparecycles_worker_tasks_total{{outcome="{outcome}"}}')
    except AssertionError:  # not exported before the first task of that outcome
        return 0.0


def _coordinator_metric(procs, line: str) -> float:
    text = httpx.get(f"{procs.url}/metrics", timeout=10).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def _cfg(tmp_path, name: str) -> TrainConfig:
    # zocurv-trust, refreshes every 2 steps from warmup (1) on: versions 0, 2, 4, 6 published, rounds at 2, 4, 6
    # (base 0, 2, 4), 2 held-out batches x 5 roles = 10 group_line rounds each
    return TrainConfig(model="gpt2-tiny", corpus="classics-small", optimizer="zocurv-trust", steps=8, batch_size=2,
                       seq_len=16, lr=3e-3, warmup_steps=1, eval_every=8, eval_batches=1, checkpoint_every=100,
                       probe_batch_size=1, curvature_interval=2, run_dir=tmp_path / name,
                       optimizer_options={"batches": 2, "start": "one", "agree": 1, "z_min": 0.1})


def test_trust_on_a_fleet_folds_at_the_next_refresh_and_resumes(one_worker, tmp_path, fail_at_step):
    """`up`'s timing ("next"): each refresh's rounds fold at the refresh after (the trainer waits for them only
    before publishing the version after that); Ctrl-C with a refresh's 10 rounds in flight, resume on a new
    coordinator run: the checkpoint carries them (each held-out batch once) and θ_t, θ_prev; they are re-issued
    and fold at the same step, and the run equals the uninterrupted one bit for bit."""
    procs, settings = one_worker

    def attach() -> Fleet:
        return Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="trust", rounds="next")

    straight = train(_cfg(tmp_path, "straight"), progress=False, export=False, hooks=TrainHooks(mode_factory=attach().mode_factory))
    folded = [(r["step"], r["tr_version"]) for r in metrics_records(straight.run_dir) if "tr_version" in r]
    assert folded == [(5, 2.0), (7, 4.0)]  # logged steps count from 1: refresh 2 folds at 4, 4 at 6, 6 never
    undo = fail_at_step(ZOCurvMode, 5)  # checkpointed after step 4: refresh 4's rounds in flight
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path, "resumed"), progress=False, export=False, hooks=TrainHooks(mode_factory=attach().mode_factory))
    undo()
    with safe_open(str(tmp_path / "resumed" / "checkpoint.safetensors"), framework="pt") as f:
        inflight = json.loads(f.metadata()["sparecycles"])["meta"]["mode"]["curvature"]["inflight"]
        held = [k for k in f.keys() if k.startswith("extra/round/")]  # noqa: SIM118 (safe_open has no __iter__)
    assert len(inflight) == 10 and {d["version"] for d in inflight} == {4} and len(held) == 2 * 2  # 2 batches (x, y)
    resumed = train(_cfg(tmp_path, "resumed"), resume=True, progress=False, export=False,
                    hooks=TrainHooks(mode_factory=attach().mode_factory))
    assert resumed.summary["resumed_from_step"] == 5
    keys = ("loss", "val_loss", "tr_version", "mult_embed", "mult_qk", "tr_z_ffn")
    after = [(r["step"], k, r[k]) for r in metrics_records(resumed.run_dir) for k in keys if k in r and r["step"] > 5]
    assert after and after == [(r["step"], k, r[k]) for r in metrics_records(straight.run_dir) for k in keys
                               if k in r and r["step"] > 5]  # floats compared exactly
    assert_same_checkpoints(straight.run_dir, resumed.run_dir)
