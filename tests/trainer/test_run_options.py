"""RunOptions (trainer.run_options): the run's options that are not training settings, one typed model with one
default each; its cross-option rules are validators, tested here without the CLI; `train` and `up` generate their
options from it, so no option is declared twice."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.main import get_command

from sparecycles.cli import app
from sparecycles.up_options import NOT_UP_OPTIONS, UP_RUN_OPTIONS, UpOptions, split_given
from trainer.run_options import FLEET_ROUNDS, NOT_OPTIONS, UP_FLEET_WAIT, RunOptions

COMMANDS = get_command(app).commands  # type: ignore[attr-defined]


@pytest.mark.parametrize(("given", "message"), [
    ({"fleet_wait": "sync"}, "--fleet-wait (and --fleet-sync) say when the trainer waits"),
    ({"require_fleet": True}, "--require-fleet needs --coordinator"),
    ({"eval_on": "fleet"}, "--eval-on fleet needs --coordinator"),
    ({"fleet": True, "eval_on": "fleet", "nproc_per_node": 2}, "a trainer of 2 ranks evaluates on its ranks"),
    ({"kd_strict": True}, "--kd-strict say how the trainer sends and waits for teacher rounds"),
    ({"kd_window": 4, "teacher_queue": "q1"}, "--teacher-queue, --kd-window say how"),
    ({"teacher_rounds": "redis://h:6379/0", "kd_cache": "/tmp/c"}, "--kd-cache replaces --teacher-rounds"),
    ({"teacher_rounds": "http://h:6379/0"}, "should match pattern"),
    ({"teacher_queue": "Bad Name", "teacher_rounds": "redis://h/0"}, "should match pattern"),
    ({"eval_on": "gpu"}, "'trainer', 'fleet' or 'auto'"),
    ({"eval_deadline": -1}, "greater than or equal to 0"),
    ({"metrics_port": 70000}, "less than or equal to 65535"),
])
def test_validators_refuse_naming_the_option(given, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunOptions(**given)


def test_what_the_rules_accept_and_resolve():
    alone = RunOptions()
    assert (alone.eval_place, alone.rounds(), alone.fleet_wait) == ("trainer", "async", None)
    fleet = RunOptions(fleet=True)
    assert fleet.eval_place == "fleet" and fleet.rounds(UP_FLEET_WAIT) == FLEET_ROUNDS["interval"] == "next"
    assert RunOptions(fleet=True, nproc_per_node=2).eval_place == "trainer"  # a sharded forward is collective
    assert RunOptions(fleet=True, fleet_wait="sync").rounds(UP_FLEET_WAIT) == "sync"
    taught = RunOptions(teacher_rounds="redis://h:6379/0", kd_strict=True, kd_window=4, teacher_queue="kd-1")
    assert (taught.kd_window, taught.teacher_queue) == (4, "kd-1")


def test_train_and_up_declare_no_option_twice():
    """Each RunOptions field is an option of `train`; `up` takes those of UP_RUN_OPTIONS, from the same field (same
    help, same default shown), and every option name of a command appears once."""
    train = {p.name: p for p in COMMANDS["train"].params}
    up = {p.name: p for p in COMMANDS["up"].params}
    for command in ("train", "up"):
        names = [p.name for p in COMMANDS[command].params]
        assert len(names) == len(set(names)), command
    run_fields = [n for n in RunOptions.model_fields if n not in NOT_OPTIONS]
    assert set(run_fields) <= set(train)
    assert set(UP_RUN_OPTIONS) <= set(up) and not (set(NOT_UP_OPTIONS) - set(NOT_OPTIONS)) & set(up)
    for name in UP_RUN_OPTIONS:
        assert train[name].help == up[name].help and train[name].default == up[name].default is None, name
    assert set(UpOptions.model_fields) <= set(up)


def test_plan_up_sorts_its_keywords_to_their_models():
    assert split_given({"steps": 5, "workers": 3, "fleet_wait": "sync"}) == (
        {"workers": 3}, {"fleet_wait": "sync"}, {"steps": 5})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        split_given({"stepz": 5})


def test_up_serving_options_name_their_engine_and_need_one():
    assert UpOptions().serving_demo is None
    demo = UpOptions(serving="vllm", serving_rate=0.5, serving_requests=12, serving_hold=0.5).serving_demo
    assert (demo.engine, demo.rate, demo.requests, demo.hold_s) == ("vllm", 0.5, 12, 0.5)
    assert UpOptions(serving="vllm").serving_demo.requests == 40  # the defaults: 40 requests at 0.1/s, hold 2 s
    with pytest.raises(ValidationError, match="--serving-hold applies with --serving vllm only"):
        UpOptions(serving_hold=1.0)
    with pytest.raises(ValidationError, match="greater than 0"):
        UpOptions(serving="vllm", serving_rate=0.0)
    with pytest.raises(ValidationError, match="'none' or 'vllm'"):
        UpOptions(serving="sglang")


def test_up_serving_without_the_vllm_venv_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from sparecycles.up_plan import plan_up

    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "cache"))  # tools/vllm.sh's venv lives under it: none
    with pytest.raises(ValueError, match=r"--serving vllm: no vLLM venv at .*run `bash tools/vllm.sh install`"):
        plan_up(serving="vllm", steps=3, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_up_gpus_auto_refuses_a_workers_count_naming_both():
    """--gpus auto starts one worker per GPU after the first (fleet.devices.place) and would ignore --workers: both
    given are refused at validation, whatever the count; each alone is accepted."""
    with pytest.raises(ValidationError, match=r"--gpus auto and --workers 3 conflict: .*leave --workers out, or leave "
                                              r"--gpus out and give --device cuda:0 --worker-devices"):
        UpOptions(gpus="auto", workers=3)
    with pytest.raises(ValidationError, match="--gpus auto and --workers 2 conflict"):
        UpOptions(gpus="auto", workers=2)  # the default count, given: still refused
    assert (UpOptions(gpus="auto").gpus, UpOptions(workers=3).workers) == ("auto", 3)
