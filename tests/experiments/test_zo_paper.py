"""1.5-SPSA's published regime (issue 18): bf16 in-place numerics, plateau rule, with-replacement batches,
per-iteration h/w statistics, and the arm runner on a tiny CPU classifier."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from experiments.zo_paper.steps import (
    PAPER,
    PlateauState,
    ZOParamStepper,
    batch_rows,
    inplace_perturb_,
    numerics_drift,
    plateau_update,
)
from probe_kernels.reference import direction_ref
from support.zo_paper import TinyClassifier, tiny_paper_data


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """Round fp32 values to bf16 (round to nearest, ties to even) by bit arithmetic; returns fp32 values."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def _reference_cycle(w: np.ndarray, seed: int, offset: int, eps: float) -> np.ndarray:
    """The public code's +ε, −2ε, +ε on bf16 weights, each op in fp32 then one rounding to bf16 (numpy)."""
    z = direction_ref(seed, offset, w.size, "rademacher").numpy().reshape(w.shape)
    for a in (eps, -2.0 * eps, eps):
        w = _bf16_rne(w.astype(np.float32) + np.float32(a) * z)
    return w


def test_bf16_inplace_cycle_equals_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(7)
    # two tensors at back-to-back offsets, the second crossing Rademacher's 128-element Philox calls
    tensors = [(torch.randn(37, generator=g) * 0.05).to(torch.bfloat16),
               (torch.randn(6, 50, generator=g) * 0.05).to(torch.bfloat16)]
    offsets = [0, 37]
    start = [t.float().numpy().copy() for t in tensors]
    seed, eps = 123456789, 1e-4
    for a in (eps, -2.0 * eps, eps):
        inplace_perturb_(tensors, offsets, seed, a)
    for t, w0, off in zip(tensors, start, offsets):
        ref = _reference_cycle(w0, seed, off, eps)
        assert np.array_equal(t.float().numpy().view(np.uint32), ref.view(np.uint32))
    # in bf16 the cycle does not restore every weight (that is the drift the A2 arm accumulates) ...
    changed = sum(int((t.float().numpy() != w0).sum()) for t, w0 in zip(tensors, start))
    assert changed > 0
    # ... while fp32 weights with the same steps come back within an ulp
    w32 = [torch.from_numpy(w0.copy()) for w0 in start]
    for a in (eps, -2.0 * eps, eps):
        inplace_perturb_(w32, offsets, seed, a)
    for t, w0 in zip(w32, start):
        assert np.allclose(t.numpy(), w0, rtol=0, atol=1e-7)


def test_plateau_rule_halves_after_patience_flat_iterations():
    s = PlateauState()
    for acc in (0.5, 0.6, 0.7):  # improving: never halves
        s = plateau_update(s, acc, patience=3)
    assert (s.best, s.since, s.halvings, s.scale) == (0.7, 0, 0, 1.0)
    for i, acc in enumerate((0.7, 0.65, 0.7)):  # equal or worse: counts up, halves on the 3rd
        s = plateau_update(s, acc, patience=3)
        assert s.halvings == (1 if i == 2 else 0)
    assert (s.best, s.since, s.scale) == (0.7, 0, 0.5)
    for _ in range(3):  # a second plateau halves again
        s = plateau_update(s, 0.1, patience=3)
    assert s.scale == 0.25
    s = plateau_update(s, 0.71, patience=3)  # a new best resets the counter, keeps the halvings
    assert (s.best, s.since, s.halvings) == (0.71, 0, 2)
    flat = PlateauState()
    for _ in range(PAPER.patience):
        flat = plateau_update(flat, 0.5)
    assert flat.halvings == 0  # the first call sets the best; 49 flat ones follow
    flat = plateau_update(flat, 0.5)
    assert flat.halvings == 1
    with pytest.raises(ValueError, match="patience"):
        plateau_update(PlateauState(), 0.5, patience=0)
    with pytest.raises(ValueError, match="finite"):
        plateau_update(PlateauState(), math.nan)


def test_batches_are_drawn_with_replacement_as_a_pure_function_of_seed_and_iteration():
    a = batch_rows(3, 17, 1000, 512)
    torch.manual_seed(0)
    torch.rand(5)  # global RNG state must not matter
    b = batch_rows(3, 17, 1000, 512)
    assert a.dtype == torch.int64 and a.shape == (512,)
    assert torch.equal(a, b)
    assert not torch.equal(a, batch_rows(3, 18, 1000, 512))
    assert not torch.equal(a, batch_rows(4, 17, 1000, 512))
    assert int(a.min()) >= 0 and int(a.max()) < 1000
    assert a.unique().numel() < 512  # with replacement: 512 of 1000 repeat some rows (expected ~ 115 repeats)
    assert batch_rows(0, 0, 1, 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        batch_rows(0, 0, 0, 4)


class _Quadratic(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.linspace(-0.1, 0.1, n))


def _sq(model, batch):
    return (model.theta.double() ** 2).sum()


@pytest.mark.parametrize(("lam", "w", "floored"), [(1.0, 16.0 ** -0.1, 0.0), (2.0, 0.5, 1.0)])
def test_h_and_w_statistics_on_a_quadratic(lam, w, floored):
    """L = ‖θ‖² has H = 2I: every Rademacher probe of n = 8 weights has h = zᵀHz = 2n = 16 exactly, so
    w = 1/max(16^0.1, λ) (16^0.1 = 1.32: floored at λ = 2, not at λ = 1)."""
    st = ZOParamStepper(_Quadratic(8), "1.5spsa", numerics="master", probes=5, lam=lam)
    out = st.step(0, None, _sq, lr=1e-3, eps=1e-2)
    assert out["h_mean"] == pytest.approx(16.0, rel=1e-4)
    assert out["h_std"] == pytest.approx(0.0, abs=1e-2)
    assert out["w_mean"] == pytest.approx(w, rel=1e-4)
    assert out["frac_weight_floored"] == floored
    assert out["forward_passes"] == 1 + 2 * 5
    # the step is −(lr/K) Σ w_k g_k z_k with g_k = 2θᵀz_k: replay it by hand
    theta0 = torch.linspace(-0.1, 0.1, 8, dtype=torch.float64)
    zs = [direction_ref(s, 0, 8, "rademacher").double() for s in out["seeds"]]
    expect = theta0 - (1e-3 / 5) * sum(w * 2 * (theta0 @ z) * z for z in zs)
    assert torch.allclose(st.model.theta.double(), expect, atol=1e-6)


@pytest.mark.parametrize("numerics", ["master", "inplace"])
def test_zo_arm_logs_selects_on_val_and_scores_test_once(numerics):
    from experiments.zo_paper.paper import run_zo_arm

    data = tiny_paper_data()
    dtype = torch.float32 if numerics == "master" else torch.bfloat16
    arm = {"name": "t", "method": "1.5spsa", "numerics": numerics, "lr": 0.5, "eps": 1e-2, "batch_size": 16,
           "probes": 4, "max_iters": 6, "eval_every": 2, "time_s": 1e9, "patience": 2}
    r = run_zo_arm(data, TinyClassifier().to(dtype), arm, seed=0)
    assert r["iterations"] == 6 and r["stop"] == "max_iters" and r["forward_passes"] == 6 * 9
    assert r["seq_forwards"] == 6 * 9 * 16
    assert [e["iteration"] for e in r["evals"]] == [0, 2, 4, 6]
    sel = max(r["evals"], key=lambda e: (e["val_acc"], -e["iteration"]))
    assert r["selected_iteration"] == sel["iteration"] and r["val_acc"] == sel["val_acc"]
    assert r["test_acc"] == sel["test_acc_peek"]  # the selected weights, scored again at the end
    assert r["best_on_test_peek"]["test_acc"] == max(e["test_acc_peek"] for e in r["evals"])
    assert r["test_se"] == pytest.approx(math.sqrt(r["test_acc"] * (1 - r["test_acc"]) / 30))
    for row in r["log"]:
        assert set(row) >= {"loss", "train_acc", "lr", "eps", "h_mean", "h_std", "w_mean", "frac_weight_floored"}
        assert 0.0 <= row["frac_weight_floored"] <= 1.0 and 0 < row["w_mean"] <= 1.0
    halved = [row["lr"] for row in r["log"]]
    assert all(x in (0.5, 0.25, 0.125, 0.0625) for x in halved)


def test_backprop_arm_and_drift_on_tiny_model():
    from experiments.zo_paper.paper import run_backprop_arm

    data = tiny_paper_data()
    r = run_backprop_arm(data, TinyClassifier(), {"name": "b", "lr": 0.05, "batch_size": 8, "max_iters": 30,
                                          "eval_every": 10, "time_s": 1e9})
    assert r["iterations"] == 30 and r["val_acc"] >= r["evals"][0]["val_acc"]
    m = TinyClassifier().to(torch.bfloat16)
    w = [m.emb.data, m.head.data]
    d = numerics_drift(w, [0, 80], [([1, 2], [1e-3, -1e-3], 1e-3), ([3, 4], [2e-3, 0.0], 1e-3)])
    assert d["steps"] == 2 and d["cycles"] == 4
    assert 0.0 <= d["restore_changed_frac"] <= 1.0 and d["update_rel_l2_master"] > 0
    empty = numerics_drift(w, [0, 80], [])
    assert empty["restore_rel_l2"] == 0.0 and empty["inplace_vs_master_changed_frac"] == 0.0


def test_paper_regime_options_are_checked_before_running(tmp_path):
    from experiments.zo.cli import bench_zo

    app = typer.Typer()
    app.command()(bench_zo)
    for args, hint in ((["--regime", "paper", "--model", "minilm"], "--model"),
                       (["--regime", "paper", "--model", "smollm2", "--arms", "A9"], "--arms"),
                       (["--regime", "paper", "--model", "smollm2", "--arms", "A3w"], "--arms"),
                       (["--regime", "paper", "--model", "smollm2", "--fp32-matmul", "medium"], "--fp32-matmul"),
                       (["--regime", "bogus"], "--regime")):
        res = CliRunner().invoke(app, ["--part", "sentiment", "--out", str(tmp_path / "o"), *args])
        assert res.exit_code == 2, res.output
        assert hint in res.output


def test_paper_comparison_runs_every_arm_and_writes_the_table(tmp_path):
    """The orchestration on the tiny classifier: every arm, A3w's lr from A1's mean w, the drift, JSON + PNGs."""
    import json

    from experiments.zo_paper.paper import PaperCall, paper_arms, paper_comparison

    data = tiny_paper_data()
    s = paper_comparison(tmp_path, lambda dt: TinyClassifier().to(dt), data, PaperCall(total_s=3600.0, iters_cap=2))
    names = [a["name"] for a in paper_arms(3.0)]
    assert all(r["iterations"] == 2 and r["stop"] == "max_iters" for r in s["arms"].values())
    assert [r["arm"] for r in s["table"]] == names
    ws = [x["w_mean"] for x in s["arms"]["A1"]["log"]]
    assert s["arms"]["A3w"]["lr"] == pytest.approx(PAPER.lr * sum(ws) / len(ws))
    assert s["drift"]["steps"] == s["arms"]["A1"]["iterations"]
    assert s["arms"]["A2"]["numerics"] == "inplace"
    assert json.loads((tmp_path / "paper_summary.json").read_text())["table"] == s["table"]
    assert (tmp_path / "paper_curves.png").stat().st_size > 0 and (tmp_path / "paper_hw.png").stat().st_size > 0
    # a call whose budget is already spent runs nothing and says so (the device call must end in time)
    none = paper_comparison(tmp_path / "late", lambda dt: TinyClassifier().to(dt), data, PaperCall(total_s=1e-9,
                                                                                       arms=("A1", "A2")))
    assert none["table"] == [] and none["meta"]["skipped"] == dict.fromkeys(("A1", "A2"), "no time left in this call")
    import time

    late = paper_comparison(tmp_path / "late2", lambda dt: TinyClassifier().to(dt), data,  # a deadline already past:
                            PaperCall(total_s=3600.0, arms=("A1",), end_by=time.time() - 1.0))  # 3600 s -> nothing
    assert late["table"] == [] and late["meta"]["calls"][-1]["total_s"] <= 0


def test_with_lr_zero_the_start_is_selected_and_scored():
    """No evaluation beats the start: the selection is iteration 0 (earliest of equal bests), scored on the
    start's weights."""
    from experiments.zo_paper.paper import run_zo_arm

    data = tiny_paper_data()
    arm = {"name": "z", "method": "1spsa", "numerics": "master", "lr": 0.0, "eps": 1e-2, "batch_size": 8,
           "probes": 2, "max_iters": 4, "eval_every": 2, "time_s": 1e9}
    r = run_zo_arm(data, TinyClassifier(), arm)
    assert r["selected_iteration"] == 0
    assert r["test_acc"] == r["evals"][0]["test_acc_peek"] == r["initial_test_acc"]
