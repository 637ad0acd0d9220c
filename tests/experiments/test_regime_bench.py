"""Issue 29's benchmark plan (experiments.regime.plan): the adaptive stages, and its scoring (experiments.regime.score)."""

from __future__ import annotations

import pytest

from experiments.regime.plan import (
    ADAMW,
    CPU,
    FULL,
    H200,
    Plan,
    RegimeRun,
    bracket_lrs,
    next_runs,
    run_config,
)
from experiments.regime.score import arm_key, summarize, tables

PLAN = Plan({}, t_ref=100, adamw_lrs=(1.0, 2.0, 4.0), schedules=("cosine", "linear"),
            arms=(("zocurv-static", ()), ("zocurv-trust", (("start", "one"),))), fracs=(0.75, 0.5), adamw_seeds=3)


def _bracket(finals: dict[float, float], plan: Plan = PLAN) -> dict[str, float]:
    return {RegimeRun(ADAMW, lr, plan.t_ref, s).name: v + (0.01 if s == "linear" else 0.0)
            for lr, v in finals.items() for s in plan.schedules}


def test_stage_one_is_the_bracket_then_seeds_and_arms_at_the_best():
    first = next_runs(PLAN, {})
    assert [r.name for r in first] == [RegimeRun(ADAMW, lr, 100, s).name for lr in (1.0, 2.0, 4.0)
                                       for s in ("cosine", "linear")]
    done = _bracket({1.0: 3.2, 2.0: 3.0, 4.0: 3.1})
    runs = next_runs(PLAN, done)
    new = [r for r in runs if r.name not in done]
    assert new == [RegimeRun(ADAMW, 2.0, 100, "cosine", seed=1), RegimeRun(ADAMW, 2.0, 100, "cosine", seed=2),
                   RegimeRun("zocurv-static", 2.0, 100, "cosine"),
                   RegimeRun("zocurv-trust", 2.0, 100, "cosine", options=(("start", "one"),))]


def test_bracket_extends_beyond_a_best_edge():
    done = _bracket({1.0: 3.2, 2.0: 3.1, 4.0: 3.0})
    assert bracket_lrs(PLAN, done) == [1.0, 2.0, 4.0, 8.0]
    assert {r.lr for r in next_runs(PLAN, done) if r.name not in done} == {8.0}  # nothing else until bracketed
    done |= _bracket({8.0: 3.05})
    assert bracket_lrs(PLAN, done) == [1.0, 2.0, 4.0, 8.0]


def test_arms_go_shorter_while_they_reach_the_target_and_get_a_second_seed():
    done = _bracket({1.0: 3.2, 2.0: 3.0, 4.0: 3.1})
    done |= {RegimeRun(ADAMW, 2.0, 100, "cosine", seed=s).name: 3.0 for s in (1, 2)}  # target 3.0
    static = RegimeRun("zocurv-static", 2.0, 100, "cosine")
    trust = RegimeRun("zocurv-trust", 2.0, 100, "cosine", options=(("start", "one"),))
    done |= {static.name: 3.05, trust.name: 2.95}  # static misses at T_ref: ratio > 1, nothing shorter
    new = [r for r in next_runs(PLAN, done) if r.name not in done]
    assert new == [RegimeRun("zocurv-trust", 2.0, 75, "cosine", options=trust.options)]
    done[new[0].name] = 2.99  # reached at 75: a second seed there, and 50
    new = [r for r in next_runs(PLAN, done) if r.name not in done]
    assert [(r.steps, r.seed) for r in new] == [(75, 1), (50, 0)]
    done[new[0].name] = 3.05  # the 2-seed mean at 75 (3.02) misses: no shorter run
    assert [r for r in next_runs(PLAN, done) if r.name not in done] == []


def test_one_call_plan_starts_everything_at_once():
    runs = next_runs(H200, {})
    assert {r.optimizer for r in runs} == {ADAMW, "zocurv-static", "zocurv-trust"}
    assert len(runs) == len(set(runs)) == 8
    assert FULL.settings["batch_size"] * FULL.settings["seq_len"] == 64 * 1024 and FULL.t_ref == 400
    assert len(FULL.adamw_lrs) >= 4 and FULL.schedules == ("cosine", "linear")


def test_run_config_follows_the_protocol(tmp_path):
    spec = RegimeRun("zocurv-trust", 1e-3, 40, "linear", seed=2, options=(("start", "one"),))
    cfg = run_config(spec, CPU.settings, "cpu", tmp_path)
    assert (cfg.schedule, cfg.steps, cfg.warmup_steps, cfg.min_lr, cfg.eval_every, cfg.seed) == ("linear", 40, 4,
                                                                                                 1e-4, 20, 2)
    assert cfg.optimizer_options == {"start": "one"} and (cfg.beta1, cfg.beta2, cfg.weight_decay) == (0.9, 0.95, 0.1)


def _res(opt, lr, steps, final, seed=0, schedule="cosine", options=(), wall=10.0, probe=0.0):
    r = RegimeRun(opt, lr, steps, schedule, seed, options=options)
    return {"optimizer": opt, "lr": lr, "steps": steps, "schedule": schedule, "seed": seed, "options": list(options),
            "name": r.name, "plan": "p", "final_val_loss": final, "val_curve": [(steps, final)], "wall_s": wall,
            "probe_gpu_s": probe, "trainer_wall_s": wall - probe, "probe_forwards": 0.0, "partial": False,
            "multipliers": [{"step": 1, "mult_embed": 1.5}]}


def test_summary_ratio_and_tables():
    res = [_res(ADAMW, 1.0, 100, 3.2), _res(ADAMW, 2.0, 100, 3.0), _res(ADAMW, 4.0, 100, 3.1),
           _res(ADAMW, 2.0, 100, 3.04, seed=1), _res(ADAMW, 2.0, 100, 3.02, seed=2, schedule="linear"),
           _res("zocurv-trust", 2.0, 100, 2.9, options=(("start", "one"),), wall=12.0, probe=4.0),
           _res("zocurv-trust", 2.0, 75, 3.01, options=(("start", "one"),)),
           _res("zocurv-trust", 2.0, 75, 3.0, seed=1, options=(("start", "one"),))]
    s = summarize(res)
    assert s["target_val_loss"] == pytest.approx(3.02) and s["best_adamw"] == {"lr": 2.0, "schedule": "cosine"}
    worse_seed = summarize([*res, _res(ADAMW, 2.0, 100, 3.5, seed=2)])  # chosen on seed 0, as the plan chose it
    assert worse_seed["best_adamw"]["lr"] == 2.0 and worse_seed["target_val_loss"] == pytest.approx(3.18)
    assert s["adamw_bracketed"] and s["adamw_seed_spread"] == pytest.approx(0.04)
    a = s["arms"][arm_key(res[5])]
    assert a["step_ratio"] == 0.75 and a["seeds_at_reached_T"] == 2 and a["seed_spread_at_reached_T"] == pytest.approx(0.01)
    assert a["wall_ratio_probes_elsewhere"] == pytest.approx(8.0 / 10.0) and a["probe_gpu_s"] == 4.0
    md = tables(s)
    assert "| zocurv-trust[start=one]@2/cosine | 100: 2.9000, 75: 3.0050 | 0.750 |" in md


def test_a_run_that_fails_is_reported_once_not_restarted(tmp_path):
    """A run whose process exits without a summary (here: an unknown corpus) is not started again every second
    (that truncated its log and hid the error); it comes back among the unfinished, its log holding the reason."""
    from experiments.regime.plan import run_plan

    left = run_plan("cpu", tmp_path, jobs=2, devices=["cpu"], deadline_s=240.0,
                    settings={**CPU.settings, "corpus": "no-such-corpus"})
    first = [r.name for r in next_runs(CPU, {})]
    assert sorted(left) == sorted(first)
    for name in first:
        log = (tmp_path / f"{name}.log").read_text()
        assert "no-such-corpus" in log, log[-2000:]


def test_micro_batches_give_the_run_of_the_whole_batch(tmp_path):
    """`--micro-batch-size` (settings["micro_batch_size"]) accumulates each step's gradients over micro-batches:
    the static-table run of the cpu plan at micro-batch 1 (2 passes per step) ends where the one-pass run does
    (its gradient is the mean of two half-batch gradients: the same up to fp32 summation order, 1e-4 allowed), and a
    micro-batch that does not divide the batch is refused with the fix."""
    import json

    from experiments.regime.plan import run_one

    spec = RegimeRun("zocurv-static", 3e-3, 3)
    losses = {}
    for micro in (None, 1):
        out = tmp_path / f"mb{micro}"
        settings = {**CPU.settings, **({"micro_batch_size": micro} if micro else {})}
        run_one(spec, settings, "cpu", out)
        rows = [json.loads(x) for x in (out / spec.name / "metrics.jsonl").read_text().splitlines()]
        losses[micro] = [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses[None]) == len(losses[1]) >= 4
    assert losses[1] == pytest.approx(losses[None], abs=1e-4, rel=0)
    with pytest.raises(ValueError, match="micro-batch-size 3"):
        run_one(spec, {**CPU.settings, "micro_batch_size": 3}, "cpu", tmp_path / "bad")
