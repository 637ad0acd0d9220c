"""`--share` where a trainer attaches: the typed run options, `attach`/`connect`, `FleetCallback`, and the RunSpec
every coordinator run of the trainer carries (no coordinator needed: each refusal comes before any I/O)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from fleet.attach import Fleet, FleetSettings, FleetStatus, attach
from trainer.run_options import RunOptions
from wire.messages import RunSpec, share_fields


def test_run_options_bound_the_share_and_need_a_fleet() -> None:
    assert RunOptions().share == 1.0
    assert RunOptions(fleet=True, share=2.5).share == 2.5
    for bad in (0.0, -1.0, 1000.5, math.inf, math.nan):
        with pytest.raises(ValidationError, match="share"):
            RunOptions(fleet=True, share=bad)
    with pytest.raises(ValidationError, match="--share is a share of a fleet's pool: it needs --coordinator"):
        RunOptions(share=2.0)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.inf, 5000.0])
def test_attach_refuses_a_share_out_of_bounds_before_any_connection(bad: float) -> None:
    with pytest.raises(ValueError, match="a share must be a finite number > 0 and <= 1000"):
        attach("http://127.0.0.1:9", share=bad, wait_s=0.0)  # port 9: nothing is ever contacted


def test_share_fields_give_the_run_spec_its_share() -> None:
    assert share_fields(1.0) == {}
    spec = RunSpec(run="r", model_class="M", **share_fields(3.0))
    assert (spec.share, spec.schema_version) == (3.0, 2)
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec


def test_fleet_callback_states_its_share_on_the_fleet() -> None:
    from sparecycles.hf import FleetCallback
    from trainer.evaluation import EvalWindows

    windows = EvalWindows("lm", "val", (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)), 2)
    fleet = Fleet("http://127.0.0.1:9", FleetSettings(admin_token="x" * 32, redis_url="redis://127.0.0.1:6379/0"),
                  2, FleetStatus("http://127.0.0.1:9"))
    cb = FleetCallback(windows, fleet=fleet, share=4.0)
    assert cb.fleet.share == 4.0 and fleet.share == 1.0  # the caller's fleet is left as it was
    with pytest.raises(ValueError, match="needs `fleet`"):
        FleetCallback(windows, share=2.0)
    with pytest.raises(ValueError, match="a share must be a finite number > 0 and <= 1000, got 0.0"):
        FleetCallback(windows, fleet=fleet, share=0.0)
