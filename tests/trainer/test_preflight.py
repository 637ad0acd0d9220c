"""Checks before anything runs (trainer.preflight, sparecycles.up.plan_up) and the report's pure helpers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from sparecycles.up import UP_SETTINGS, plan_up, sum_fleet, unfolded_warning
from trainer.config import TrainConfig, resolve_preset
from trainer.preflight import folder_state, probe_rounds, run_settings
from trainer.report import (
    bias_corrected_ema,
    binomial_se,
    loss_unit,
    plot_accuracy_and_loss,
    plot_loss_curves,
)


def test_probe_rounds_closed_form():
    line = resolve_preset("demo", {"optimizer": "zocurv-line", "steps": 15, "curvature_interval": 15})
    assert probe_rounds(line) == 0  # rounds at steps 15, 30, ...: none in steps 0..14
    assert probe_rounds(line.model_copy(update={"steps": 16})) == 1
    assert probe_rounds(line.model_copy(update={"steps": 150})) == 9
    block = line.model_copy(update={"optimizer": "zocurv-block"})
    assert probe_rounds(block) == 1  # zocurv-block also probes at step 0
    assert probe_rounds(line.model_copy(update={"optimizer": "mezo"})) is None
    assert probe_rounds(line.model_copy(update={"optimizer": "zocurv-global"})) == 0
    assert probe_rounds(line.model_copy(update={"optimizer": "zocurv-group"})) == 1
    assert probe_rounds(line.model_copy(update={"optimizer": "zocurv-group-fixed"})) is None  # probes by design never
    # zocurv-trust: along θ_s − θ_{s−k} and only from warmup on: refreshes 20 and 25 of steps 0..29 (warmup 17)
    trust = line.model_copy(update={"optimizer": "zocurv-trust", "steps": 30, "curvature_interval": 5,
                                    "warmup_steps": 17})
    assert probe_rounds(trust) == 2 and probe_rounds(trust.model_copy(update={"warmup_steps": 0})) == 5
    from trainer.preflight import no_probe_round_warning

    assert "first round is sent at step 20" in no_probe_round_warning(trust.model_copy(update={"steps": 20}))


def test_preflight_knows_every_optimizer():
    from trainer.methods import METHODS

    # Every registered method gets an answer; those with probe rounds get a count (trainer.methods is the one list).
    base = TrainConfig(steps=31, curvature_interval=10, warmup_steps=0)  # zocurv-trust probes from warmup on
    for name, m in METHODS.items():
        rounds = probe_rounds(base.model_copy(update={"optimizer": name}))
        assert (rounds is None) == (m.kind != "zo-curv" or not m.needs_probes), name
        if rounds is not None:
            assert rounds == (3 if m.probes_along_step else 4), name


def _fake_run(folder, cfg, *, finished: bool, checkpoint: bool = True, fleet_wait: str | None = None,
              steps_recorded: bool = True):
    """The files `trainer.train.train` leaves: config.json (with steps, or without as before they were recorded;
    probes from a fleet waiting as `fleet_wait` says, None: in process), metrics, summary when finished."""
    folder.mkdir(parents=True)
    settings = run_settings(cfg, fleet_wait)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in settings.items()
                                                    if k != "steps" or steps_recorded}))
    (folder / "metrics.jsonl").write_text('{"step": 0, "val_loss": 10.8}\n')
    if checkpoint:
        (folder / "checkpoint.safetensors").write_bytes(b"x")
    if finished:
        (folder / "summary.json").write_text(json.dumps({"steps": cfg.steps}))


def test_folder_state_kinds(tmp_path):
    cfg = resolve_preset("demo", {"optimizer": "adamw"})
    assert folder_state(tmp_path / "none", cfg).kind == "empty"
    _fake_run(tmp_path / "done", cfg, finished=True)
    assert folder_state(tmp_path / "done", cfg).kind == "done"
    other = folder_state(tmp_path / "done", resolve_preset("demo", {"optimizer": "adamw", "steps": 5}))
    assert other.kind == "other" and "steps: 150 -> 5" in other.diffs and "warmup_steps: 15 -> 0" in other.diffs
    _fake_run(tmp_path / "cut", cfg, finished=False)
    assert folder_state(tmp_path / "cut", cfg).kind == "resume"
    assert folder_state(tmp_path / "cut", cfg.model_copy(update={"lr": 1e-3})).diffs == ("lr: 0.003 -> 0.001",)
    longer = cfg.model_copy(update={"steps": 300})  # another --steps is another run unless --resume extends it
    assert folder_state(tmp_path / "cut", longer).diffs == ("steps: 150 -> 300",)
    _fake_run(tmp_path / "older", cfg, finished=False, steps_recorded=False)  # steps unknown: the rest is judged
    assert folder_state(tmp_path / "older", longer).kind == "resume"
    # An extension to 300 stopped midway: config.json's 300 is the run's, not the finished part's summary (150).
    (tmp_path / "done" / "config.json").write_text(json.dumps(run_settings(longer)))
    assert folder_state(tmp_path / "done", longer).kind == "resume"


def test_up_default_folder_carries_the_settings_and_a_finished_run_is_never_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    demo = plan_up()
    assert demo.out == tmp_path / "up-demo-zocurv-line" and demo.warnings == ()
    assert plan_up(steps=150).out == demo.out  # the preset's own value names no tag
    assert plan_up(steps=5, curvature_interval=4).out.name == "up-demo-zocurv-line-steps5-ci4"
    # A finished demo in the default folder; `--steps 5 --run-dir` that folder is refused, naming the change.
    demo.out.mkdir()
    (demo.out / UP_SETTINGS).write_text(json.dumps(demo.settings))
    for name, cfg in (("adamw", demo.base_cfg), ("zocurv-line", demo.zo_cfg)):
        _fake_run(demo.out / name, cfg, finished=True, fleet_wait=demo.fleet_wait)
    assert {k: s.kind for k, s in plan_up().states.items()} == {"adamw": "done", "zocurv-line": "done"}
    with pytest.raises(ValueError, match="steps: 150 -> 5.*--overwrite"):
        plan_up(steps=5, run_dir=demo.out)
    with pytest.raises(ValueError, match="optimizer: 'zocurv-line' -> 'zocurv-block'"):
        plan_up(optimizer="zocurv-block", run_dir=demo.out)
    assert plan_up(steps=5, run_dir=demo.out, overwrite=True).clear


def test_up_set_gives_both_runs_the_settings_and_refuses_what_up_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    plan = plan_up(optimizer="zocurv-global", steps=40, train_options=("lr=6e-4", "warmup-steps=4", "min_lr=6e-5"))
    for cfg in (plan.base_cfg, plan.zo_cfg):
        assert (cfg.lr, cfg.warmup_steps, cfg.min_lr, cfg.staleness) == (6e-4, 4, 6e-5, 30)
    assert (plan.base_cfg.optimizer, plan.zo_cfg.optimizer) == ("adamw", "zocurv-global")
    assert plan_up(train_options=("staleness=7",)).zo_cfg.staleness == 7
    assert plan_up(train_options=("steps=3", "seq-len=16")).zo_cfg.steps == 3  # `train`'s option names
    for bad, msg in (("lr", "KEY=VALUE"), ("optimizer=mezo", "not a setting of both runs"),
                     ("lr=-1", "lr=-1: .*greater than 0"), ("eps=2", "eps=2: .*less than or equal to 1")):
        with pytest.raises(ValueError, match=msg):
            plan_up(train_options=(bad,))
    with pytest.raises(ValueError, match="steps given twice"):  # as --steps and as --set steps
        plan_up(steps=5, train_options=("steps=3",))
    with pytest.raises(ValueError, match="given twice"):
        plan_up(train_options=("lr=1e-3", "lr=2e-3"))
    with pytest.raises(ValueError, match="sends no probes"):  # every zocurv variant with probes runs on a fleet
        plan_up(optimizer="zocurv-group-fixed")


def test_steps_below_the_curvature_interval_warn(tmp_path):
    """`up` plans the warning; `train` prints it, writes it to summary.json, and indeed probes nothing."""
    assert "no curvature probe round in 5 steps" in plan_up(steps=5).warnings[0]
    run_dir = tmp_path / "r"
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", "--preset", "gpt2-tiny", "--optimizer",
                          "zocurv-line", "--steps", "2", "--curvature-interval", "2", "--batch-size", "2",
                          "--seq-len", "16", "--no-progress", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning: run too short for its interval: zocurv-line applies no curvature probe round in 2 steps" in res.stderr
    assert "equals AdamW" in json.loads((run_dir / "summary.json").read_text())["warnings"][0]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2] and not any("curv_dropped_rounds" in r for r in recs)
    # The same command again: the finished run is reused, nothing trained.
    again = subprocess.run(res.args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "reused" in again.stderr and (run_dir / "metrics.jsonl").read_text() == \
        "".join(json.dumps(r) + "\n" for r in recs)


def test_report_ema_and_standard_error_closed_forms():
    assert bias_corrected_ema([3.0] * 5, 0.9) == pytest.approx([3.0] * 5)  # a weighted mean of equal values
    b = 0.8
    assert bias_corrected_ema([1.0, 2.0], b) == pytest.approx([1.0, (b * 1.0 + 2.0) / (1 + b)])
    assert binomial_se(0.5, 100) == pytest.approx(0.05) and binomial_se(1.0, 10) == 0.0
    assert math.isclose(binomial_se(0.7, 128), math.sqrt(0.21 / 128))


def test_plots_write_pngs_with_units(tmp_path):
    import matplotlib.image

    lm = [{"step": 0, "val_loss": 10.0}] + [{"step": s, "loss": 10.0 - s / 10} for s in range(1, 31)] + \
        [{"step": 30, "val_loss": 7.0}]
    assert loss_unit(lm) == "nats/token"
    png = plot_loss_curves({"a": lm, "b": lm}, tmp_path / "l.png", title="t")
    assert matplotlib.image.imread(png).shape[1] > matplotlib.image.imread(png).shape[0]  # two panels side by side
    cls = [{**r, "val_acc": 0.6} if "val_loss" in r else r for r in lm]
    assert loss_unit(cls) == "nats/sentence"
    assert plot_accuracy_and_loss({"a": cls}, tmp_path / "c.png", title="t", chance=0.5, n_val=128).is_file()


def test_fleet_figures_of_a_resumed_run_add_up_its_parts():
    a = {"workers": 2.0, "tasks_published": 10.0, "results_accepted": 30.0, "results_stale": 2.0, "seconds": 10.0,
         "probes_per_s": 3.0, "stale_fraction": 2 / 32}
    b = {"workers": 1.0, "tasks_published": 4.0, "results_accepted": 12.0, "results_held": 4.0, "seconds": 30.0,
         "probes_per_s": 0.4, "stale_fraction": 0.0}
    assert sum_fleet([a]) == a
    s = sum_fleet([a, b])
    assert (s["workers"], s["tasks_published"], s["results_accepted"], s["results_held"]) == (2.0, 14.0, 42.0, 4.0)
    assert s["probes_per_s"] == pytest.approx((30 + 12) / 40) and s["stale_fraction"] == pytest.approx(2 / 48)
    assert s["parts"] == 2


def test_a_zocurv_run_whose_rounds_never_completed_is_flagged():
    sent = {"curv_accepted": 48.0, "curv_pending_rounds": 2.0}  # refresh records of a slow fleet (measured)
    slow = [{"step": 5, "loss": 9.0, **sent}, {"step": 9, "loss": 8.0, **sent}]
    assert "none completed" in unfolded_warning("zocurv-line", slow) and "2 still pending" in unfolded_warning(
        "zocurv-line", slow)
    folded = slow + [{"step": 13, "loss": 7.0, **sent, "curv_median": 0.1}]
    assert unfolded_warning("zocurv-line", folded) is None
    assert unfolded_warning("1.5spsa", [{"step": 1, "loss": 0.69}]) is None


def test_up_optimizer_options_reach_the_probed_run_and_name_its_folder(tmp_path, monkeypatch):
    """`up --optimizer-option start=one`: the fleet-probed run's optimizer_options (the AdamW baseline's stay
    empty), a folder of its own (-start-one), and a knob the method does not have refused, naming it."""
    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    plan = plan_up(optimizer="zocurv-trust", optimizer_options={"start": "one"})
    assert plan.out.name == "up-demo-zocurv-trust-start-one"
    assert dict(plan.zo_cfg.optimizer_options) == {"start": "one"} and not plan.base_cfg.optimizer_options
    with pytest.raises(ValueError, match="start"):
        plan_up(optimizer="zocurv-trust", optimizer_options={"start": "bogus"})


def test_up_with_a_teacher_plans_teacher_rounds_and_refuses_what_cannot_distil(tmp_path, monkeypatch):
    """`up --teacher DIR`: both runs distil and their targets come from teacher workers (sampled/topk, in `up`'s
    process); --kd-estimator full keeps the teacher in the trainer. A teacher folder without a tokenizer and a
    pure-ZO fleet run are refused by plan_up, before any process starts."""
    from trainer.export import export_model, gpt2_tokenizer
    from trainer.models import build_model

    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    teacher = export_model(build_model("gpt2-tiny", seed=3), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    plan = plan_up(settings={"teacher": str(teacher)})
    assert plan.teacher_rounds and plan.base_cfg.teacher == plan.zo_cfg.teacher == str(teacher)
    assert not plan_up(settings={"teacher": str(teacher), "kd_estimator": "full"}).teacher_rounds
    (teacher / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="--teacher: .*no tokenizer files"):
        plan_up(settings={"teacher": str(teacher)})
    with pytest.raises(ValueError, match="pure-zo"):
        plan_up(optimizer="mezo", settings={"teacher": str(teacher)})


def test_up_serving_names_its_own_folder_and_a_plain_up_drops_a_stale_serving_json(tmp_path, monkeypatch):
    """`--serving vllm` is part of the default folder's name (a plain `up` with the same settings never reuses the
    folder holding serving.json, nor the other way round); a plain `up` in a --run-dir an `up --serving` used
    removes that run's serving.json rather than leave it beside its own summary."""
    from sparecycles.up import run_up
    from sparecycles.up_options import UpOptions
    from sparecycles.up_plan import _folder

    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path))
    zo, default = (resolve_preset("demo", {"optimizer": "zocurv-line", **s}) for s in ({"steps": 5}, {}))
    plain = _folder(UpOptions(), zo, default, None)  # _folder: plan_up's naming, without the vLLM venv check
    serving = _folder(UpOptions(serving="vllm", serving_rate=0.5), zo, default, None)
    assert (plain.name, serving.name) == ("up-demo-zocurv-line-steps5", "up-demo-zocurv-line-steps5-serving-vllm")
    # Both runs of a plain `up` finished in a folder an `up --serving` left serving.json in: reused, no engine.
    plan = plan_up(steps=5, run_dir=tmp_path / "shared")
    plan.out.mkdir()
    (plan.out / UP_SETTINGS).write_text(json.dumps(plan.settings))
    for name, cfg in (("adamw", plan.base_cfg), ("zocurv-line", plan.zo_cfg)):
        _fake_run(plan.out / name, cfg, finished=True, fleet_wait=plan.fleet_wait)
    (plan.out / "serving.json").write_text(json.dumps({"engine": "vllm", "answered": 40}))
    plan = plan_up(steps=5, run_dir=tmp_path / "shared")
    assert plan.serving is None and {s.kind for s in plan.states.values()} == {"done"}
    summary = run_up(plan, progress=False, export=False, log=lambda m: None)
    assert summary["reused"] == ["adamw", "zocurv-line"] and "serving" not in summary
    assert not (plan.out / "serving.json").exists() and "serving.json" not in summary["disk_mb"]


def test_a_folder_of_runs_is_named_with_its_runs_count(tmp_path):
    """trainer.run_dir.not_a_run_folder: a folder of one run says "1 run" and "export it", of two "2 runs" and
    "export one of them", each naming the last run's folder; a run folder itself is fine (None)."""
    from trainer.run_dir import not_a_run_folder

    (tmp_path / "adamw").mkdir()
    (tmp_path / "adamw" / "config.json").write_text("{}")
    assert not_a_run_folder(tmp_path) == (f"{tmp_path} holds 1 run (adamw; a `sparecycles up` folder): export it, "
                                          f"e.g. `sparecycles export {tmp_path / 'adamw'} OUT_DIR`")
    (tmp_path / "zo").mkdir()
    (tmp_path / "zo" / "config.json").write_text("{}")
    assert not_a_run_folder(tmp_path).startswith(f"{tmp_path} holds 2 runs (adamw, zo; a `sparecycles up` folder): "
                                                 "export one of them, e.g.")
    assert not_a_run_folder(tmp_path / "zo") is None


@pytest.mark.parametrize("overwrite", [False, True])
def test_up_refuses_a_train_run_folder_and_leaves_it_as_it_was(tmp_path, overwrite):
    """`up --run-dir` naming a `train` run folder (config.json at its top) is refused before anything is written:
    `up` writes its own summary.json there, and --overwrite would delete the run's (sparecycles.up_plan._folder)."""
    run = tmp_path / "t1"
    run.mkdir()
    files = {"config.json": '{"optimizer": "adamw"}', "summary.json": '{"final_val_loss": 7.3}', "curves.png": "png"}
    for name, text in files.items():
        (run / name).write_text(text)
    with pytest.raises(ValueError, match=r"is a `sparecycles train` run folder .*nothing was changed"):
        plan_up(run_dir=run, steps=5, overwrite=overwrite)
    assert {p.name: p.read_text() for p in run.iterdir()} == files
