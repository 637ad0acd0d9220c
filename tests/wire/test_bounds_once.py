"""Each bound and default written once: --kd-k's 1..MAX_KD_K and the probe step's default PROBE_EPS live in
wire.bounds, Adam's ε (ADAM_EPS) in trainer.zo.optimizers apart from the probe's; every holder reads them there."""

from __future__ import annotations

import inspect

import pytest
from pydantic import BaseModel, ValidationError

from trainer.cli_settings import bounds
from trainer.config import TrainConfig
from trainer.kd.cache import KDPlan
from trainer.zo.optimizers import ADAM_EPS, Probing, ZOCurvBlockAdamW, ZOCurvLine, ZOCurvSophia
from trainer.zo.regime_mode import BlockTableAdamW
from trainer.zo.role_rules import ScaledAdamW, ZOCurvRoleAdamW
from wire import engine_answers, kd_targets
from wire.bounds import MAX_KD_K, PROBE_EPS
from wire.teacher_messages import TeacherTask


@pytest.mark.parametrize(("model", "field"), [(TrainConfig, "kd_k"), (TeacherTask, "k"), (KDPlan, "k")])
def test_kd_k_has_one_bound(model: type[BaseModel], field: str):
    assert bounds(model.model_fields[field]) == {"ge": 1, "le": MAX_KD_K}
    with pytest.raises(ValidationError):
        TrainConfig(kd_k=MAX_KD_K + 1)
    assert kd_targets.MAX_K == engine_answers.MAX_ENGINE_K == MAX_KD_K


def _default(cls: type, name: str):
    return inspect.signature(cls.__init__).parameters[name].default


def _probe_eps(cls: type) -> float:
    """`cls`'s default probe ε: its own `probe_eps`, or that of its default `probing` group (Probing)."""
    params = inspect.signature(cls.__init__).parameters
    return params["probe_eps"].default if "probe_eps" in params else params["probing"].default.probe_eps


def test_probe_eps_and_adams_eps_are_named_apart_with_one_default_each():
    assert TrainConfig.model_fields["eps"].default == PROBE_EPS == 1e-3
    assert Probing().probe_eps == PROBE_EPS
    for cls in (ZOCurvBlockAdamW, ZOCurvSophia, ZOCurvLine, ScaledAdamW):
        assert _probe_eps(cls) == PROBE_EPS, cls
    for cls in (ZOCurvBlockAdamW, ZOCurvLine, ScaledAdamW, ZOCurvRoleAdamW, BlockTableAdamW):
        assert _default(cls, "eps") == ADAM_EPS == 1e-8, cls
    assert _default(ZOCurvSophia, "eps") == 1e-12  # Sophia's own (Liu et al. 2023), not Adam's


def test_the_request_rate_has_one_bound():
    """`bench serving-load --rate`, `bench serving --rate` and `up --serving-rate` send benchmarks.serving_load's
    load: one bound (benchmarks.serving_options.RequestRate), so a rate `up` takes is one `serving-load` takes
    (serving-load refused 0.005/s, which up sent)."""
    from benchmarks.serving_options import ServingBench, ServingLoad
    from sparecycles.up_options import UpOptions

    fields = (ServingLoad.model_fields["rate"], ServingBench.model_fields["rate"],
              UpOptions.model_fields["serving_rate"])
    assert [bounds(f) for f in fields] == [{"gt": 0.0, "le": 100.0}] * 3
    assert ServingLoad(rate=0.005).rate == UpOptions(serving="vllm", serving_rate=0.005).serving_rate == 0.005
    for bad in (0.0, 100.5, float("inf")):
        with pytest.raises(ValidationError):
            ServingLoad(rate=bad)
        with pytest.raises(ValidationError):
            UpOptions(serving="vllm", serving_rate=bad)
