"""Scoring of the issue-17 fair comparison (experiments.zocurv_fair.fair): pure functions on synthetic runs."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from experiments.zocurv_fair.fair import FairRun, fair_config, final_plan, h200_plan, step_ratio, summarize
from experiments.zocurv_fair.score import merge_runs, variant_key


def test_step_ratio_smallest_full_schedule_reaching_the_target():
    finals = {200: 5.40, 300: 5.20, 400: 5.05}
    assert step_ratio(finals, 5.25, 400) == {"step_ratio": 0.75, "interp_ratio": pytest.approx((200 + 100 * 0.15 / 0.2) / 400),
                                             "reached_T": 300}
    assert step_ratio(finals, 5.0, 400)["step_ratio"] is None
    assert step_ratio(finals, 5.5, 400) == {"step_ratio": 0.5, "interp_ratio": 0.5, "reached_T": 200}


def _run(opt, lr, steps, wu=0.1, seed=0, final=5.0, wall=10.0, probe=0.0, plan="", **extra):
    return {"optimizer": opt, "lr": lr, "partial": False, "steps_done": steps, "steps": steps, "warmup_frac": wu, "seed": seed, "name": f"{opt}{lr}{steps}{seed}",
            "final_val_loss": final, "val_curve": [(0, 11.0), (steps, final)], "wall_s": wall, "probe_gpu_s": probe,
            "trainer_wall_s": wall - probe, "probe_forwards": 0.0, "multipliers": [], "plan": plan, **extra}


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
    cfg = fair_config(FairRun("adamw", 1e-3, 400, 0.05), dict(model="gpt2-tiny", corpus="classics-small",
                      batch_size=4, seq_len=32), "cpu", None)
    assert (cfg.min_lr, cfg.warmup_steps, cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (
        pytest.approx(1e-4), 20, 0.9, 0.95, 0.1, 1.0)
    plan = h200_plan()
    lrs = {s.lr for s in plan if s.optimizer == "adamw"}
    assert min(lrs) <= 3e-4 and max(lrs) >= 1.5e-3  # bracketed on both sides (issue 17)
    assert {s.warmup_frac for s in plan if s.optimizer == "adamw"} == {0.05, 0.1}


def test_seeds_are_averaged_per_T_and_compared_with_adamw_at_equal_T():
    """Old call ("a"): AdamW grid at T_ref; new call ("b"): a third AdamW seed, AdamW at T = 300, and a variant
    at T = 300 (two seeds) and 400 that carries optimizer options."""
    opts = [["negative", "skip"]]
    runs = [_run("adamw", 6e-4, 400, final=5.10, wall=40, plan="a"), _run("adamw", 6e-4, 400, seed=1, final=5.14, plan="a"),
            _run("adamw", 3e-4, 400, final=5.3, plan="a"), _run("adamw", 1.2e-3, 400, final=5.2, plan="a"),
            _run("adamw", 6e-4, 400, seed=2, final=5.12, wall=40, plan="b"),
            _run("adamw", 6e-4, 300, final=5.20, wall=30, plan="b"),
            _run("zg", 6e-4, 300, final=5.11, wall=33, probe=3, plan="b", options=opts),
            _run("zg", 6e-4, 300, seed=1, final=5.13, wall=36, probe=3, plan="b", options=opts),
            _run("zg", 6e-4, 400, final=5.0, wall=44, probe=4, plan="b", options=opts)]
    s = summarize(runs)
    assert s["t_ref"] == 400 and s["adamw_seeds_at_best"] == 3 and s["target_val_loss"] == pytest.approx(5.12)
    assert s["adamw_best_finals_by_T"] == {300: pytest.approx(5.20), 400: pytest.approx(5.12)}
    assert s["adamw_step_ratio"] == 1.0  # AdamW's own T = 300 misses its target
    v = s["variants"]["zg@0.0006[negative=skip]"]
    assert v["options"] == {"negative": "skip"}
    assert v["finals_by_T"] == {300: pytest.approx(5.12), 400: pytest.approx(5.0)}
    assert v["finals_by_T_seeds"][300] == [5.11, 5.13]
    assert v["gap_vs_adamw_same_T"] == {300: pytest.approx(-0.08), 400: pytest.approx(-0.12)}
    assert (v["step_ratio"], v["reached_T"]) == (0.75, 300)  # mean 5.12 <= 5.12
    # paired by seed: T = 300 seed 0 (5.11 − 5.20), T = 400 seed 0 (5.0 − 5.10); seed 1 at 300 has no AdamW pair
    assert v["paired_gaps"] == {300: {0: pytest.approx(-0.09)}, 400: {0: pytest.approx(-0.10)}}
    assert v["paired_gap_mean"] == pytest.approx(-0.095)
    # wall at T_ref: (44 − 4) / 40 against the same call's AdamW (seed 2), not call a's seed 0
    assert v["wall_reference"] == "adamw0.00064002" and v["wall_ratio_probes_elsewhere"] == pytest.approx(1.0)
    # at the reached T = 300: 0.75 × ((33 − 3)/300) / (30/300), against the same call's AdamW at T = 300
    assert v["wall_ratio_at_reached_T"] == pytest.approx(0.75) and v["wall_reference_at_reached_T"] == "adamw0.00063000"


def test_fair_run_options_name_and_json_round_trip():
    r = FairRun("zocurv-group-global", 6e-4, 400, options=(("negative", "skip"),))
    assert r.name == "zocurv-group-global-lr0.0006-T400-wu10-s0-negativeskip"
    back = FairRun(**json.loads(json.dumps(asdict(r))))
    assert back == r and back.options == (("negative", "skip"),)
    assert FairRun("adamw", 6e-4, 400).name == "adamw-lr0.0006-T400-wu10-s0"  # unchanged without options
    assert variant_key(asdict(r)) == "zocurv-group-global@0.0006[negative=skip]" == variant_key(json.loads(json.dumps(asdict(r))))
    cfg = fair_config(r, dict(model="gpt2-tiny", corpus="classics-small", batch_size=2, seq_len=16), "cpu", None)
    assert cfg.optimizer_options == {"negative": "skip"}


def test_merge_runs_keeps_folder_results_over_earlier_summaries():
    new = [_run("adamw", 6e-4, 400, seed=2, final=5.2, plan="c")]
    old = {"runs": [_run("adamw", 6e-4, 400, final=5.1, plan="a"), {**_run("adamw", 6e-4, 400, seed=2, final=9.9), "plan": "c"}],
           "partial_runs": [{**_run("zg", 6e-4, 400), "partial": True, "plan": "a"}]}
    got = merge_runs(new, [old])
    assert [(r["name"], r["final_val_loss"], r["partial"]) for r in got] == [
        ("adamw0.00064002", 5.2, False), ("adamw0.00064000", 5.1, False), ("zg0.00064000", 5.0, True)]


def test_final_plan_adds_the_third_seed_and_shorter_schedules():
    plan = final_plan()
    names = [r.name for r in plan]
    assert len(set(names)) == len(names) == 7
    assert FairRun("adamw", 6e-4, 400, seed=2) in plan
    assert {(r.steps, r.seed) for r in plan if r.optimizer == "zocurv-global"} == {(350, 0), (350, 1), (300, 0)}
    assert {r.steps for r in plan if r.optimizer == "adamw"} == {300, 350, 400}
    gg = next(r for r in plan if r.optimizer == "zocurv-group-global")
    assert (gg.steps, dict(gg.options)) == (400, {"negative": "skip"})
