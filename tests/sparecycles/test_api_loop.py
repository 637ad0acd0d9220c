"""The public loop API (sparecycles.loop, sparecycles.hf): ZO-Curv as a torch.optim.Optimizer equals the CLI
trainer's ZO-Curv mode bit for bit and its state_dict round-trips; the Hugging Face Trainer example
(examples/hf_trainer.py) runs against a real coordinator and a real worker process, the fleet's eval_loss equals
Trainer's own on the same windows, and the anytime model's export loads with AutoModelForCausalLM."""

from __future__ import annotations

import hashlib
import io
import json
import math
import secrets
import subprocess
import sys

import pytest
import torch

from support.paths import ROOT


def _tiny(seed: int = 0):
    sys.path.insert(0, str(ROOT / "examples"))
    from hf_trainer import tiny_gpt2

    return tiny_gpt2(seed, 16)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, 256, (4, 17), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


SETTINGS = dict(lr=1e-3, curvature_interval=2, probes=4, probe_batch_size=2, seed=3, grad_clip=1.0)


def _wrapper_steps(model, opt, steps: range) -> list[float]:
    from trainer.models.losses import lm_batch_loss

    losses = []
    for s in steps:
        batch = _batch(s)
        opt.zero_grad(set_to_none=True)
        loss = lm_batch_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS["grad_clip"])
        opt.probe_batch(batch)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_zocurv_optimizer_equals_the_trainers_zocurv_mode_bit_for_bit():
    import sparecycles as sc
    from trainer.config import TrainConfig
    from trainer.mode_builders import build_mode

    ref_model, model = _tiny(), _tiny()
    mode = build_mode(TrainConfig(optimizer="zocurv-block", **SETTINGS), ref_model)
    ref = [mode.step(s, _batch(s), SETTINGS["lr"])["loss"] for s in range(6)]
    opt = sc.ZOCurv(model, **SETTINGS)
    assert isinstance(opt, torch.optim.Optimizer)
    assert _wrapper_steps(model, opt, range(6)) == ref
    assert opt.rule.curv.ready  # the refreshes folded: the multipliers were not all 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))


def test_zocurv_state_dict_round_trips():
    import sparecycles as sc

    model = _tiny()
    opt = sc.ZOCurv(model, **SETTINGS)
    _wrapper_steps(model, opt, range(4))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # through bytes, as a checkpoint (the live state_dict shares tensors)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    want = _wrapper_steps(model, opt, range(4, 8))  # the uninterrupted continuation

    other = _tiny(seed=1)
    other.load_state_dict(saved)
    again = sc.ZOCurv(other, **SETTINGS)
    again.load_state_dict(sd)
    assert again.version == 4
    assert _wrapper_steps(other, again, range(4, 8)) == want
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
    with pytest.raises(KeyError):
        again.load_state_dict({k: v for k, v in sd.items() if k != "zo_curv"})


@pytest.mark.slow
def test_hf_trainer_example_on_a_real_fleet(tmp_path):
    from transformers import AutoModelForCausalLM

    from support.fleet import REDIS_URL, Fleet

    f = Fleet(tmp_path)
    try:
        f.start_worker("a")
        f.wait_consuming("a")
        env = {**f.env, "SPARECYCLES_REDIS_URL": REDIS_URL}
        env.pop("SPARECYCLES_BLOB_DIR")  # the example uploads over HTTP, as a loop on another machine would
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--coordinator", f.url,
                              "--out", str(tmp_path / "run")], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        got = json.loads((tmp_path / "run" / "result.json").read_text())
        _publish_a_version(f)
    finally:
        f.close()
    env = {k: v for k, v in env.items() if k != "SPARECYCLES_COORDINATOR_URL"}
    here = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--out", str(tmp_path / "here")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert here.returncode == 0, here.stderr[-4000:]
    local = json.loads((tmp_path / "here" / "result.json").read_text())
    # ZO-Curv's probe rounds ran on the worker (rounds="sync"): the curvature was folded and the run is the
    # in-process one bit for bit.
    assert got["curvature_ready"] and got["probe_forwards"] > 0 and got["rounds"]["curv_folded_rounds"] >= 1
    assert got["multipliers"] == local["multipliers"] != [1.0] * len(local["multipliers"])
    assert got["trainer_eval_loss"] == local["trainer_eval_loss"]
    assert [r["val_loss"] for r in got["fleet_records"]] == [r["val_loss"] for r in local["fleet_records"]]
    records = {r["step"]: r for r in got["fleet_records"]}
    assert sorted(records) == [3, 6]
    assert all(r["eval_on"] == "fleet" for r in records.values())  # the worker answered every batch
    # Trainer's eval_loss is a float32 mean of the same 4 batch losses the fleet averages in float64.
    assert math.isclose(records[6]["val_loss"], got["trainer_eval_loss"], rel_tol=1e-6)
    assert got["served"]["served"] in {"raw", "ema1", "avg2"} and math.isfinite(got["served"]["served_val_loss"])
    model = AutoModelForCausalLM.from_pretrained(got["export"])
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == 256


def _publish_a_version(f) -> None:
    """connect with explicit credentials, then VersionChannel: the coordinator holds the version's manifest, whose
    shards carry the model's bytes."""
    import sparecycles as sc
    from fleet.publisher import write_shards
    from support.fleet import REDIS_URL
    from trainer.models.params import param_order_hash

    fleet = sc.connect(f.url, admin_token=f.admin_token, redis_url=REDIS_URL, key_prefix=f.prefix, wait_s=30.0)
    assert fleet.workers == 1
    model = _tiny(seed=5)
    channel = sc.VersionChannel(model, fleet)
    try:
        channel.publish(3)
        channel.flush()
        m = channel.manifest(3)
        assert (m.version, m.model_class, m.param_order_hash) == (3, "GPT2LMHeadModel", param_order_hash(model))
        want = [hashlib.sha256(b).hexdigest() for _, b in write_shards(model)]
        assert [s.sha256 for s in m.shards] == want
        with pytest.raises(ValueError, match="not newer"):
            channel.publish(3)
    finally:
        channel.close()
    with pytest.raises(sc.FleetError, match="refused the admin token"):
        sc.connect(f.url, admin_token=secrets.token_urlsafe(24), redis_url=REDIS_URL, key_prefix=f.prefix, wait_s=5.0)
