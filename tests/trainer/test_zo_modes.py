"""Pure-ZO steps against hand-computed updates; every ZO mode through trainer.train with resume."""

from __future__ import annotations

import json

import pytest
import torch

from probe_kernels import direction
from support.quadratic import QuadraticModel, quad_loss
from support.resume import assert_same_checkpoints
from trainer.config import TrainConfig
from trainer.train import train
from trainer.zo import estimators as est
from trainer.zo.backend import InProcessBackend
from trainer.zo.zo_step import ZOStepper

SIZES = [6, 10, 3]
OFFSETS = [0, 6, 16]


@pytest.mark.parametrize("method", ["mezo", "1spsa", "1.5spsa"])
def test_zo_step_applies_the_formula(method):
    model = QuadraticModel(SIZES, seed=11)
    theta0 = model.theta()
    lr, wd, eps, alpha, lam = 0.05, 0.1, 1e-2, 1.0, 0.5
    stepper = ZOStepper(model, method, run_seed=3, probes=4, eps=eps, alpha=alpha, lam=lam, weight_decay=wd)
    stats = stepper.step(7, None, InProcessBackend(model, quad_loss), lr)
    seeds = est.step_seeds(3, 7, 1 if method == "mezo" else 4)
    dist = "gauss8" if method == "mezo" else "rademacher"
    z = torch.stack([direction(s, 0, 19, dist) for s in seeds]).double()
    g = z @ model.grad_at(theta0)  # exact slopes of the quadratic
    h = torch.einsum("ki,ij,kj->k", z, model.h, z)
    w = 1.0 / torch.clamp(h.abs() ** alpha, min=lam) if method == "1.5spsa" else torch.ones_like(g)
    # Parameters are 1-D here, so the decoupled decay (matrices only) does not apply.
    expected = theta0 - (lr / len(seeds)) * ((w * g)[:, None] * z).sum(0)
    torch.testing.assert_close(model.theta(), expected, rtol=1e-4, atol=1e-5)
    assert stats["forward_passes"] == 2 * len(seeds) + (method == "1.5spsa")
    if method == "1.5spsa":
        assert stats["h_mean"] == pytest.approx(float(h.mean()), rel=1e-3)


def test_decoupled_decay_on_matrices_and_bf16_masters():
    lin = torch.nn.Linear(4, 3).to(torch.bfloat16)
    def loss_fn(m, b):
        return (m(b).float() ** 2).mean()
    batch = torch.linspace(-1, 1, 8).view(2, 4).to(torch.bfloat16)
    stepper = ZOStepper(lin, "1spsa", run_seed=1, probes=2, eps=1e-2, weight_decay=0.5)
    w0 = [p.detach().float().clone() for p in lin.parameters()]
    stepper.step(0, batch, InProcessBackend(lin, loss_fn), lr=1e-3)
    masters = stepper.masters
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(lin.parameters(), masters):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    # The weight matrix shrank by (1 - lr*wd) before the (tiny) seeded update; the bias did not decay.
    delta_w = masters[0] - w0[0] * (1 - 1e-3 * 0.5)
    assert float(delta_w.abs().max()) < 1e-3 * 50  # only the replayed ZO term remains


def _cfg(tmp_path, optimizer: str, name: str, **kw) -> TrainConfig:
    base = dict(model="gpt2-tiny", corpus="classics-small", optimizer=optimizer, steps=4, batch_size=2, seq_len=16,
                lr=1e-3, warmup_steps=1, eval_every=2, eval_batches=1, checkpoint_every=2, probes=2,
                probe_batch_size=1, curvature_interval=2, eps=1e-2, run_dir=tmp_path / name)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("optimizer", ["zocurv-block", "zocurv-line", "1.5spsa"])
def test_modes_train_and_resume_bit_identically(tmp_path, optimizer):
    straight = train(_cfg(tmp_path, optimizer, "straight"), progress=False)
    cfg = _cfg(tmp_path, optimizer, "resumed")
    train(_cfg(tmp_path, optimizer, "resumed", steps=2), progress=False)  # stop after the step-2 checkpoint
    resumed = train(cfg, resume=True, progress=False)
    assert_same_checkpoints(straight.run_dir, resumed.run_dir)
    assert resumed.final_val_loss == straight.final_val_loss
    records = [json.loads(x) for x in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4 and all("forward_passes" in r for r in steps)
    if optimizer.startswith("zocurv") and optimizer != "zocurv-line":
        refresh = [r for r in steps if "curv_accepted" in r]
        assert [r["step"] for r in refresh] == [1, 3] and refresh[-1]["curv_accepted"] == 4


def test_zocurv_line_resumes_after_a_refresh_that_failed_midway(tmp_path, monkeypatch):
    """A refresh step that fails after its publish (a fleet's bounded retries spent) is checkpointed at that
    step; the resumed run re-runs the step without re-publishing its version (the first resume used to stop at
    'version 4 is not newer than 4') and equals the uninterrupted run bit for bit."""
    from coordinator.errors import Unavailable
    from trainer.zo.optimizers import ZOCurvLine

    straight = train(_cfg(tmp_path, "zocurv-line", "straight", steps=6), progress=False)
    cfg = _cfg(tmp_path, "zocurv-line", "resumed", steps=6)
    real = ZOCurvLine.make_rounds

    def outage(self, batch, version, published):
        if version == 4:  # after step 4's publish, before its round
            raise Unavailable("Redis unreachable for 60 s")
        return real(self, batch, version, published)

    monkeypatch.setattr(ZOCurvLine, "make_rounds", outage)
    with pytest.raises(RuntimeError, match="checkpointed at step 4"):
        train(cfg, progress=False)
    monkeypatch.setattr(ZOCurvLine, "make_rounds", real)
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.summary["resumed_from_step"] == 4
    assert_same_checkpoints(straight.run_dir, resumed.run_dir)
    assert resumed.final_val_loss == straight.final_val_loss
