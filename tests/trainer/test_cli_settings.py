"""One config, one place: `train`'s and `up`'s training options are generated from TrainConfig's fields
(trainer.cli_settings): every field has an option, with the field's own bound, and `up --set` takes the same names."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, Field, ValidationError
from typer.main import get_command

from sparecycles.cli import app
from sparecycles.up_plan import NOT_SETTABLE
from trainer.anytime.settings import AnytimeSettings
from trainer.cli_settings import BY_NAME, SECTION, SETTINGS, _settings, bounds, parse_set
from trainer.config import TrainConfig

COMMANDS = get_command(app).commands  # type: ignore[attr-defined]


def _fields() -> list[tuple[str, tuple[str, ...]]]:
    """(option name, path) of every TrainConfig field and, for the nested anytime model, of its flag and sub-fields."""
    out = []
    for name in TrainConfig.model_fields:
        if name == "anytime":
            out += [("anytime", ("anytime",))] + [(f"anytime_{k}", ("anytime", k)) for k in AnytimeSettings.model_fields]
        else:
            out.append((name.removesuffix("s") if name == "optimizer_options" else name, (name,)))
    return out


def _parses(command: str, option: str, value: str) -> bool:
    """Whether `sparecycles COMMAND OPTION VALUE` gets past option parsing (click's conversion; nothing runs)."""
    try:
        COMMANDS[command].make_context(command, [option, value])
    except Exception as exc:  # click's BadParameter / UsageError
        assert "Invalid value for" in str(exc) or "Usage" in str(exc) or exc.__class__.__name__ in (
            "BadParameter", "UsageError")
        return False
    return True


def _config_accepts(path: tuple[str, ...], value: float) -> bool:
    """Whether TrainConfig accepts `value` at `path` (errors of other fields or of the whole model not counted)."""
    kwargs = {path[0]: value} if len(path) == 1 else {path[0]: {path[1]: value}}
    try:
        TrainConfig(**kwargs)
    except ValidationError as exc:
        return not any(tuple(e["loc"][:len(path)]) == path for e in exc.errors())
    return True


def test_every_field_is_a_train_option_with_its_own_bound():
    params = {p.name: p for p in COMMANDS["train"].params}
    assert [s.name for s in SETTINGS] == [name for name, _ in _fields()]
    checked = 0
    for name, path in _fields():
        assert name in params, f"TrainConfig field {'.'.join(path)} has no `train` option"
        setting = BY_NAME[name]
        assert setting.path == path and params[name].opts[0] == "--" + name.replace("_", "-")
        assert setting.info.description, f"{name} has no description: its --help would be empty"
        for key, edge in bounds(setting.info).items():
            step = max(abs(edge), 1.0) * (1e-6 if isinstance(edge, float) else 0) or 1
            # the bound itself and a value just past it on the refused side, just inside on the other
            for value in (edge, edge - step if key in ("gt", "ge") else edge + step,
                          edge + step if key in ("gt", "ge") else edge - step):
                text = str(int(value)) if isinstance(edge, int) and not isinstance(edge, bool) else repr(float(value))
                assert _parses("train", setting.option, text) == _config_accepts(path, value), (name, key, value)
                checked += 1
    assert checked > 100
    # every check of one field lives in its type (what the option validates), none in a field_validator
    assert not TrainConfig.__pydantic_decorators__.field_validators
    assert not AnytimeSettings.__pydantic_decorators__.field_validators
    # the bounds that used to be re-declared (or missing) on the CLI: ProbeEps's, Staleness's, RunSeed's
    assert bounds(BY_NAME["eps"].info) == {"gt": 0.0, "le": 1.0}
    assert not _parses("train", "--eps", "0") and not _parses("train", "--eps", "1.5")
    assert not _parses("train", "--eps", "nan") and not math.isnan(BY_NAME["eps"].parse("1e-3"))
    assert not _parses("train", "--seed", str(2 ** 63)) and _parses("train", "--seed", str(2 ** 63 - 1))


def test_choices_lists_and_nested_models_parse_as_the_config_does():
    ctx = COMMANDS["train"].make_context("train", [
        "--schedule", "linear", "--optimizer", "zocurv-line", "--optimizer-option", "s_max=8",
        "--anytime-k", "4", "--anytime-half-lives", "1,3", "--data", "corpus/", "--encoding-errors", "replace"])
    assert ctx.params["schedule"] == "linear" and ctx.params["anytime_half_lives"] == (1.0, 3.0)
    for argv in (["--schedule", "cos"], ["--optimizer", "adam"], ["--encoding-errors", "ignore"],
                 ["--anytime-windows", "2,0"], ["--task", "vision"]):
        assert not _parses("train", *argv), argv
    from trainer.cli_settings import collect

    over = collect({"anytime_k": 4, "anytime_pull": True, "optimizer_option": ["s_max=8", "start=one"], "lr": None,
                    "optimizer": "zocurv-trust"})
    assert over == {"anytime": {"k": 4, "pull": True}, "optimizer_options": {"s_max": 8, "start": "one"},
                    "optimizer": "zocurv-trust"}
    over["optimizer_options"] = {"start": "one"}
    assert collect({"anytime": True}) == {"anytime": {}} and collect({"anytime": False}) == {}
    cfg = TrainConfig(**over)
    assert cfg.anytime.k == 4 and cfg.anytime.pull and cfg.optimizer_options == {"start": "one"}


def test_a_new_field_becomes_an_option_with_its_bound():
    class Extended(TrainConfig):
        warmdown_frac: float = Field(0.2, gt=0, lt=1, description="fraction of steps in the decay")

    new = {s.name: s for s in _settings(Extended)}["warmdown_frac"]
    assert new.option == "--warmdown-frac" and bounds(new.info) == {"gt": 0, "lt": 1}
    with pytest.raises(ValidationError):
        new.parse("1")
    assert new.parse("0.5") == 0.5

    class Nested(BaseModel):
        inner: AnytimeSettings | None = None

    assert [s.name for s in _settings(Nested)][:3] == ["inner", "inner_k", "inner_publish_every"]


def test_up_offers_the_same_names_and_set_takes_them():
    train = {p.name for p in COMMANDS["train"].params}
    up = {p.name for p in COMMANDS["up"].params}
    generated = {s.name for s in SETTINGS if s.path[0] not in NOT_SETTABLE}
    assert generated <= up and generated <= train and {"model", "data", "text_field"} <= up
    assert dict(COMMANDS["up"].callback.sections)[SECTION] == tuple(s.name for s in SETTINGS if s.name in generated)
    assert parse_set(["seq-len=16", "lr=6e-4", "anytime_k=4"], exclude=NOT_SETTABLE) == {
        "seq_len": 16, "lr": 6e-4, "anytime_k": 4}
    for item, message in (("eps=0", "eps=0: .*greater than 0"), ("device=cuda", "not a setting of both runs"),
                          ("nope=1", "not a setting")):
        with pytest.raises(ValueError, match=message):
            parse_set([item], exclude=NOT_SETTABLE)


def test_help_lists_the_settings_in_their_own_section():
    from typer.testing import CliRunner

    for command in ("train", "up"):
        out = CliRunner().invoke(app, [command, "--help"], terminal_width=100).output
        own, _, settings = out.partition(SECTION)
        assert "--coordinator" in own or "--workers" in own
        assert "--eps FLOAT" in settings and "Bound: 0<x<=1." in " ".join(settings.split()) and "--model TEXT" in settings
        assert settings.count("--seq-len ") == 1 and "--seq-len" not in own
        assert " ".join(settings.split()).count("demo preset: 150") == 1  # --steps: TrainConfig's default and the demo preset's


def test_a_choice_named_none_reads_as_that_choice_not_as_no_default():
    """`up --serving [none|vllm]` defaults to the choice "none": its help says `"none"`, never the `none` of an option
    left unset (--teacher); so does every generated option whose default text reads as no default ("none", "")."""
    import re

    from typer.testing import CliRunner

    from experiments.zo.cli import app as zo_app

    up = " ".join(CliRunner().invoke(app, ["up", "--help"], terminal_width=100).output.split())
    assert re.search(r'--serving \[none\|vllm\] [^[]*\[default: "none"\]', up)
    assert re.search(r"--teacher TEXT [^[]*\[default: none\]", up)  # unset: the bare word
    zo = " ".join(CliRunner().invoke(zo_app, ["--help"], terminal_width=100).output.split())
    assert re.search(r'--shares TEXT [^[]*\[default: ""\]', zo)  # an empty text, not nothing
    assert re.search(r"--part \[lm\|sentiment\|all\] [^[]*\[default: all\]", zo)  # other choices as they were
