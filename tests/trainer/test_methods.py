"""The method registry (trainer.methods): one table drives config validation, the CLI's choices, the
sentiment defaults and the builders; each method's options reach its optimizer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from support.quadratic import QuadraticModel, quad_loss
from trainer.cli_settings import BY_NAME
from trainer.config import TrainConfig, resolve_preset
from trainer.methods import KINDS, METHODS, Method, get_method, method_names
from trainer.mode_builders import BUILDERS, OPTIMIZERS, build_mode, build_optimizer
from trainer.modes import AdamWMode
from trainer.zo.modes import PureZOMode, ZOCurvMode
from trainer.zo.optimizers import ZOCurvBlockAdamW, ZOCurvLine, ZOCurvSophia


def test_every_registered_name_is_a_valid_config_and_a_cli_choice():
    option = BY_NAME["optimizer"]  # `train --optimizer`: the field's own validation, its help lists the names
    assert all(option.parse(name) == name for name in METHODS) and ", ".join(METHODS) in option.info.description
    with pytest.raises(ValidationError, match="use one of adamw"):
        option.parse("adam")
    for name, m in METHODS.items():
        assert m.name == name and m.kind in KINDS
        for task in m.tasks:
            assert TrainConfig(optimizer=name, task=task).optimizer == name
    assert method_names(kind="pure-zo", task="sentiment") == ("mezo", "1spsa", "1.5spsa")
    assert "adamw" in method_names(task="sentiment") and "zocurv-line" not in method_names(task="sentiment")
    assert not METHODS["adamw"].needs_probes and METHODS["zocurv-line"].needs_probes
    assert not METHODS["zocurv-group-fixed"].needs_probes  # the zero-probe ablation


def test_unknown_names_and_bad_pairings_are_refused():
    with pytest.raises(ValidationError, match="use one of adamw"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="unknown optimizer"):
        get_method("sgd")
    with pytest.raises(ValidationError, match="LM task"):
        TrainConfig(optimizer="zocurv-line", task="sentiment")
    with pytest.raises(ValidationError, match="s_maxx"):
        TrainConfig(optimizer="zocurv-line", optimizer_options={"s_maxx": 3})
    with pytest.raises(ValidationError, match="s_min"):
        TrainConfig(optimizer="zocurv-line", optimizer_options={"s_min": 2.0})  # must be <= 1
    with pytest.raises(ValueError, match="kind must be one of"):
        Method("x", "second-order", "x")


def test_every_method_has_a_builder_and_every_zocurv_method_an_optimizer_factory():
    """The registry names methods, trainer.mode_builders builds them: each kind has a builder and each zo-curv
    method's options class is read by a factory (a new method without one fails here, not in a user's run); a
    first-order method asked for a ZO-Curv optimizer is refused."""
    assert set(BUILDERS) == set(KINDS)
    assert all(m.options in OPTIMIZERS for m in METHODS.values() if m.kind == "zo-curv")
    with pytest.raises(ValueError, match="not a ZO-Curv optimizer"):
        build_optimizer(TrainConfig(optimizer="adamw"), QuadraticModel([3, 4], seed=0))


def test_sentiment_default_lr_comes_from_the_registry():
    for name in method_names(task="sentiment"):
        cfg = resolve_preset("sentiment-demo", {"optimizer": name})
        assert cfg.lr == METHODS[name].sentiment_lr
    assert resolve_preset("sentiment-demo", {"optimizer": "mezo", "lr": 3e-4}).lr == 3e-4


def test_run_json_keeps_old_config_files_resumable():
    assert "optimizer_options" not in TrainConfig().run_json()  # as written before the field existed
    cfg = TrainConfig(optimizer="zocurv-line", optimizer_options={"s_max": 8})
    assert cfg.run_json()["optimizer_options"] == {"s_max": 8}


@pytest.mark.parametrize(("name", "mode_type", "opt_type"), [
    ("adamw", AdamWMode, torch.optim.AdamW),
    ("zocurv-block", ZOCurvMode, ZOCurvBlockAdamW),
    ("zocurv-sophia", ZOCurvMode, ZOCurvSophia),
    ("zocurv-line", ZOCurvMode, ZOCurvLine),
    ("1.5spsa", PureZOMode, type(None)),
])
def test_build_mode_goes_through_the_registry(name, mode_type, opt_type):
    mode = build_mode(TrainConfig(optimizer=name, probes=2), QuadraticModel([3, 4], seed=0), quad_loss)
    assert type(mode) is mode_type and type(mode.optimizer) is opt_type


def test_options_reach_the_optimizer():
    model = QuadraticModel([3, 4], seed=0)
    line = build_mode(TrainConfig(optimizer="zocurv-line", optimizer_options={"s_max": 8, "r_min": 0.25}),
                      model, quad_loss).optimizer
    assert (line.s_max, line.r_min, line.s_min) == (8.0, 0.25, 0.25)  # s_min keeps its default
    sophia = build_mode(TrainConfig(optimizer="zocurv-sophia", optimizer_options={"granularity": "coordinate"}),
                        model, quad_loss).optimizer
    assert sophia.granularity == "coordinate" and sophia.curv.size == 7
