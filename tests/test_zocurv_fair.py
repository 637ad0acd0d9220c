"""Scoring of the issue-17 fair comparison (benchmarks.zocurv_fair): pure functions on synthetic runs."""

from __future__ import annotations

import pytest

from benchmarks.zocurv_fair import FairRun, fair_config, h200_plan, step_ratio, summarize


def test_step_ratio_smallest_full_schedule_reaching_the_target():
    finals = {200: 5.40, 300: 5.20, 400: 5.05}
    assert step_ratio(finals, 5.25, 400) == {"step_ratio": 0.75, "interp_ratio": pytest.approx((200 + 100 * 0.15 / 0.2) / 400),
                                             "reached_T": 300}
    assert step_ratio(finals, 5.0, 400)["step_ratio"] is None
    assert step_ratio(finals, 5.5, 400) == {"step_ratio": 0.5, "interp_ratio": 0.5, "reached_T": 200}


def _run(opt, lr, steps, wu=0.1, seed=0, final=5.0, wall=10.0, probe=0.0):
    return {"optimizer": opt, "lr": lr, "partial": False, "steps_done": steps, "steps": steps, "warmup_frac": wu, "seed": seed, "name": f"{opt}{lr}{steps}{seed}",
            "final_val_loss": final, "val_curve": [(0, 11.0), (steps, final)], "wall_s": wall, "probe_gpu_s": probe,
            "trainer_wall_s": wall - probe, "probe_forwards": 0.0, "multipliers": []}


def test_summarize_picks_best_adamw_mean_over_seeds_and_scores_variants():
    runs = [_run("adamw", 3e-4, 400, final=5.3), _run("adamw", 6e-4, 400, final=5.10),
            _run("adamw", 6e-4, 400, seed=1, final=5.14), _run("adamw", 1.2e-3, 400, final=5.2),
            _run("adamw", 6e-4, 400, wu=0.05, final=5.13),
            _run("zocurv-group", 6e-4, 200, final=5.2, wall=6, probe=1),
            _run("zocurv-group", 6e-4, 300, final=5.1, wall=8, probe=1),
            _run("zocurv-group", 6e-4, 400, final=5.0, wall=12, probe=2)]
    s = summarize(runs)
    assert s["best_adamw"] == {"lr": 6e-4, "warmup_frac": 0.1} and s["adamw_seeds_at_best"] == 2
    assert s["target_val_loss"] == pytest.approx(5.12) and s["adamw_bracketed"]
    v = s["variants"]["zocurv-group@0.0006"]
    assert v["step_ratio"] == 0.75 and v["gap_at_T_ref"] == pytest.approx(-0.12)
    assert v["wall_ratio_probes_elsewhere"] == pytest.approx(1.0)  # (12 − 2) / 10
    with pytest.raises(ValueError):
        summarize([_run("zocurv-group", 6e-4, 400)])


def test_fair_config_follows_the_protocol():
    cfg = fair_config(FairRun("adamw", 1e-3, 400, 0.05), model="gpt2-tiny", corpus="classics-small", batch_size=4,
                      seq_len=32, device="cpu", run_dir=None)
    assert (cfg.min_lr, cfg.warmup_steps, cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (
        pytest.approx(1e-4), 20, 0.9, 0.95, 0.1, 1.0)
    plan = h200_plan()
    lrs = {s.lr for s in plan if s.optimizer == "adamw"}
    assert min(lrs) <= 3e-4 and max(lrs) >= 1.5e-3  # bracketed on both sides (issue 17)
    assert {s.warmup_frac for s in plan if s.optimizer == "adamw"} == {0.05, 0.1}
