"""Headline benchmark pieces: the pretraining report's ratios on run folders with known curves, the
1.5-SPSA-vs-MeZO reach ratio, and the linear-probe head fit on separable features."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from experiments.headline.bench import first_reach, pretrain_report
from experiments.zo.bench import fit_linear_probe_head_, reach_ratio


def _run(tmp, name, optimizer, lr, vals, step_s):
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"optimizer": optimizer, "lr": lr, "model": "gpt2-small",
                                               "corpus": "classics"}))
    recs = []
    for step, v in vals:
        if step:
            recs.append({"step": step, "loss": v, "elapsed_s": step * step_s})
        recs.append({"step": step, "val_loss": v})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_first_reach():
    assert first_reach([(0, 9.0), (10, 5.0), (20, 4.0)], 5.0) == 10
    assert first_reach([(0, 9.0), (10, 5.0)], 4.9) is None


def test_pretrain_report_ratios(tmp_path):
    a1 = _run(tmp_path, "adamw-a", "adamw", 1e-3, [(0, 10.0), (50, 6.0), (100, 5.0)], 0.1)
    a2 = _run(tmp_path, "adamw-b", "adamw", 5e-4, [(0, 10.0), (50, 5.8), (100, 4.8)], 0.1)
    z = _run(tmp_path, "zocurv", "zocurv-line", 1e-3, [(0, 10.0), (50, 4.9), (100, 4.7)], 0.4)
    out = pretrain_report([a1, a2, z], tmp_path / "rep")
    assert out["best_adamw"] == "adamw-b"
    r = out["runs"]["zocurv"]
    # best AdamW ends at 4.8: zocurv is at 4.7 <= 4.8 first at step 100 -> ratio 1.0, wall 100*0.4 / (100*0.1)
    assert r["best_adamw"]["step_reached"] == 100 and r["best_adamw"]["step_ratio"] == 1.0
    assert r["best_adamw"]["wall_ratio"] == pytest.approx(4.0)
    # same-lr AdamW ends at 5.0: zocurv's 4.9 at step 50 -> 0.5 of the steps, 2x the wall (0.4 s/step)
    assert r["same_lr_adamw"]["step_reached"] == 50 and r["same_lr_adamw"]["step_ratio"] == 0.5
    assert r["same_lr_adamw"]["wall_ratio"] == pytest.approx(2.0)
    assert (tmp_path / "rep" / "pretrain_val_loss.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="AdamW"):
        pretrain_report([z], tmp_path / "rep2")


def test_reach_ratio():
    mezo = [(0, 0.5, 0.60), (5000, 0.6, 0.65), (10000, 0.7, 0.70)]
    spsa = [(0, 0.5, 0.60), (1000, 0.6, 0.66), (2000, 0.7, 0.71), (10000, 0.8, 0.75)]
    r = reach_ratio(spsa, mezo)
    assert r["a_forwards_to_target"] == 2000 and r["forward_ratio"] == 5.0
    assert r["final_gap_points"] == pytest.approx(5.0)
    assert reach_ratio(mezo[:2], spsa)["forward_ratio"] is None


def test_linear_probe_head_separates_separable_features():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)  # test-local model init only; the code under test draws no random numbers
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (200, 8), generator=gen)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        pooled = model.bert(input_ids=ids, attention_mask=mask).pooler_output
    direction = torch.randn(16, generator=gen)
    score = pooled @ direction
    # linearly separable in the head's own input features, with a margin: the 40 sentences closest to the
    # boundary are dropped (without it L-BFGS's 200 iterations can leave a near-tie misclassified, and
    # how near depends on transformers' init code)
    keep = torch.argsort((score - score.median()).abs(), descending=True)[:160].sort().values
    ids, mask = ids[keep], mask[keep]
    labels = (score[keep] > score.median()).long()
    task = SimpleNamespace(splits={"train": (ids, mask, labels)}, _trim=lambda i, m, y: (i, m, y))
    res = fit_linear_probe_head_(model, task, batch_size=64, l2=0.0, iters=200)
    assert res["forward_passes"] == 3  # ceil(160 / 64) batched forwards
    assert res["train_acc"] == 1.0
    with torch.no_grad():
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    assert torch.equal(pred, labels)  # the fitted head was written into the model
