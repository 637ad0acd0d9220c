"""The commands converted to typed options (`kd fill`'s own options, the request rate of `bench serving-load` and
`up`; the experiment command `python -m experiments.regime run`): their --help lists each option with the default
and bound its model declares, and a value out of bounds is one line, exit 2, from the real `sparecycles` app (the
experiment's own app for `regime ...`) before anything starts; `python -m experiments.regime` is run here as a real
process too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from experiments.headline.cli import headline_app
from experiments.regime.cli import regime_app
from experiments.zo.cli import app as zo_app
from sparecycles.cli import app
from support.paths import ROOT

EXPERIMENTS = {"regime": regime_app, "headline": headline_app, "zo": zo_app}  # `python -m experiments.NAME`

UNSET = ("REDIS_URL", "SPARECYCLES_REDIS_URL")


def _app(args: list[str]):
    """(the app, its arguments): `regime ...` is the experiment's command line (`python -m experiments.regime`), as
    are `headline ...` and `zo`."""
    return (EXPERIMENTS[args[0]], args[1:]) if args[:1] and args[0] in EXPERIMENTS else (app, args)


def _help(args: list[str]) -> str:
    """`sparecycles ARGS --help`, its whitespace (click's wrapping) collapsed to single spaces."""
    res = CliRunner(env=dict.fromkeys(UNSET)).invoke(*_app([*args, "--help"]))
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


@pytest.mark.parametrize(("args", "entries"), [
    (["regime", "run"], [
        "--plan [full|h200|h200b|h200c|h200d|cpu]", "[required]", "--out PATH",
        "--jobs INTEGER runs at a time (one process each). Bound: 1<=x<=256. [default: 4]",
        "Bound: 0<x. [default: 440.0]", "[default: auto]",
        "--batch-size INTEGER override the plan's sequences per step. Bound: 1<=x<=4096. [default: none]",
        "--seq-len INTEGER override the plan's tokens per sequence. Bound: 2<=x<=8192. [default: none]",
        "--corpus TEXT override the plan's corpus. [default: none]", "--micro-batch-size INTEGER"]),
    (["kd", "fill"], [
        "--preset TEXT", "[default: demo]", "[env var: SPARECYCLES_REDIS_URL; default: redis://127.0.0.1:6379/0]",
        "--cache PATH The target cache folder", "--window INTEGER Teacher rounds out at once. Bound: 1<=x<=4096. "
        "[default: 32]", "Bound: 0.001<=x. [default: 120.0]", "Bound: 1<=x. [default: 5]",
        "--progress / --no-progress Show a progress bar. [default: on]"]),
    (["bench", "serving-load"], ["--rate FLOAT Poisson arrivals per second. Bound: 0<x<=100. [default: 0.1]"]),
    (["bench", "serving"], ["--rate FLOAT Poisson arrivals per second. Bound: 0<x<=100. [default: 0.2]"]),
    (["up"], ["(requests per second). Bound: 0<x<=100. [default: 0.1]",
              "--set KEY=VALUE KEY=VALUE: a training setting of both runs, by the name of its option below",
              "--optimizer-option KEY=VALUE KEY=VALUE: a knob of the fleet-probed run's optimizer"]),
    (["export"], ["--partial / --no-partial Export the checkpoint of an unfinished (interrupted) run. [default: off]",
                  "--overwrite / --no-overwrite Replace an earlier export in OUT_DIR (never a run or any other folder). "
                  "[default: off]", "--best / --no-best"]),
    (["coordinator"], ["--host TEXT Interface to bind (0.0.0.0 in containers). [default: 127.0.0.1]",
                       "--port INTEGER TCP port. Bound: 1<=x<=65,535. [default: 8787]",
                       "--log-level [critical|error|warning|info|debug|trace]", "[default: info]",
                       "--access-log / --no-access-log", "Bound: 1<=x<=64. [default: 1]"]),
    (["data", "fetch"], ["--corpus TEXT Corpus to build", "--task [sentiment]",
                         "--force / --no-force Rebuild even if the cache verifies. [default: off]"]),
    (["data", "pack"], ["--corpus TEXT Corpus to pack (built first if needed); ignored with --data. [default: classics-",
                        "[default: gpt2-tiny]",
                        "--text-field TEXT", "[default: text]", "--encoding-errors [strict|replace]",
                        "[default: strict]", "--out PATH", "[default: .data]"]),
    (["train"], ["--preset TEXT Run preset (demo)", "[default: demo]",
                 "[env var: SPARECYCLES_COORDINATOR_URL; default: none]", "--teacher-rounds TEXT",
                 "[env var: SPARECYCLES_TEACHER_ROUNDS; default: none]"]),
])
def test_help_lists_the_models_defaults_and_bounds(args, entries):
    text = _help(args)
    assert [e for e in entries if e not in text] == []


def _refused(args: list[str]) -> str:
    """The one error line of `sparecycles ARGS`, which must exit 2."""
    res = CliRunner(env=dict.fromkeys(UNSET)).invoke(*_app(args))
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.output)
    return lines[0]


RUN = ["regime", "run", "--plan", "cpu", "--out"]


@pytest.mark.parametrize(("args", "line"), [
    ([*RUN, "X", "--jobs", "0"], "error: --jobs: Input should be greater than or equal to 1"),
    ([*RUN, "X", "--seq-len", "1"], "error: --seq-len: Input should be greater than or equal to 2"),
    ([*RUN, "X", "--batch-size", "4097"], "error: --batch-size: Input should be less than or equal to 4096"),
    ([*RUN, "X", "--deadline-s", "0"], "error: --deadline-s: Input should be greater than 0"),
    ([*RUN, "X", "--devices", "gpu"], "error: --devices: 'gpu' is not a torch device (cpu, cuda or cuda:N)"),
    (["regime", "run", "--plan", "nope", "--out", "X"], "error: --plan: Input should be 'full', 'h200', 'h200b', 'h200c', 'h200d' or 'cpu'"),
    (["regime", "run", "--plan", "cpu"], "error: Missing option '--out'"),
    (["kd", "fill", "--window", "0"], "error: --window: Input should be greater than or equal to 1"),
    (["kd", "fill", "--window", "4097"], "error: --window: Input should be less than or equal to 4096"),
    (["kd", "fill", "--timeout", "0"], "error: --timeout: Input should be greater than or equal to 0.001"),
    (["kd", "fill", "--attempts", "0"], "error: --attempts: Input should be greater than or equal to 1"),
    (["kd", "fill", "--redis-url", "http://h:1"], "error: --redis-url (env var: SPARECYCLES_REDIS_URL): a redis:// "
     "(or rediss://) URL, got 'http://h:1'"),
    (["bench", "serving-load", "http://127.0.0.1:1", "--rate", "0"], "error: --rate: Input should be greater than 0"),
    (["bench", "serving-load", "http://127.0.0.1:1", "--rate", "101"], "error: --rate: Input should be less than or "
     "equal to 100"),
    (["up", "--serving", "vllm", "--serving-rate", "101"], "error: --serving-rate: Input should be less than or "
     "equal to 100"),
    (["up", "--serving", "vllm", "--serving-rate", "0"], "error: --serving-rate: Input should be greater than 0"),
    (["up", "--optimizer-option", "s_max"], "error: --optimizer-option: expected KEY=VALUE, got 's_max'"),
    (["up", "--optimizer-option", "s_max=8", "--optimizer-option", "s_max=9"], "error: --optimizer-option: s_max "
     "given twice"),
    (["train", "--optimizer", "zocurv-line", "--optimizer-option", "s_max=8", "--optimizer-option", "s_max=9"],
     "error: --optimizer-option: s_max given twice"),
    (["up", "--set", "steps"], "error: --set 'steps': use KEY=VALUE"),
    (["coordinator", "--port", "0"], "error: --port: Input should be greater than or equal to 1"),
    (["coordinator", "--port", "65536"], "error: --port: Input should be less than or equal to 65535"),
    (["coordinator", "--workers", "0"], "error: --workers: Input should be greater than or equal to 1"),
    (["coordinator", "--workers", "65"], "error: --workers: Input should be less than or equal to 64"),
    (["coordinator", "--log-level", "loud"], "error: --log-level: Input should be 'critical', 'error', 'warning', "
     "'info', 'debug' or 'trace'"),
    (["data", "fetch", "--task", "nope"], "error: --task: Input should be 'sentiment'"),
    (["data", "pack", "--data", "X", "--encoding-errors", "ignore"], "error: --encoding-errors: Input should be "
     "'strict' or 'replace'"),
    (["train", "--teacher-rounds", "http://h:1"], "error: --teacher-rounds (env var: SPARECYCLES_TEACHER_ROUNDS): "
     "String should match pattern '^rediss?://'"),
])
def test_a_value_out_of_bounds_is_refused_naming_its_option(args, line, tmp_path):
    got = _refused([a.replace("X", str(tmp_path / "out")) if a == "X" else a for a in args])
    assert got.startswith(line), got
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_kd_fill_options_build_the_fill_options():
    """`kd fill`'s options reach fleet.kd_fill as one FillOptions (--timeout is its timeout_s), parsed only."""
    from typer.main import get_command

    from sparecycles.kd_cli import KdFillOptions

    cmd = get_command(app).commands["kd"].commands["fill"]
    values = cmd.make_context("fill", ["--window", "8", "--timeout", "2.5", "--run", "r1", "--cache", "c"]).params
    given = {k: values[k] for k in ("window", "timeout", "run", "cache", "attempts")}
    assert given == {"window": 8, "timeout": 2.5, "run": "r1", "cache": Path("c"), "attempts": None}
    o = KdFillOptions(fill={"window": 8, "timeout_s": 2.5, "run": "r1"}, cache=Path("c"))
    assert (o.fill.window, o.fill.timeout_s, o.fill.run, o.fill.attempts, o.fill.poll_s) == (8, 2.5, "r1", 5, 0.05)
    assert KdFillOptions().redis_url == "redis://127.0.0.1:6379/0" and KdFillOptions().fill.keys is None


def test_python_m_experiments_regime_is_the_typed_command(tmp_path):
    """experiments/regime/run.sh's call, `python -m experiments.regime run ...`, as a real process: its --corpus override
    reaches every run (each fails on the unknown corpus, its log naming it), the JSON line lists them unfinished,
    and exit 1 says no run finished; a refused value is exit 2 there too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "experiments.regime", "run", "--plan", "cpu", "--out", str(tmp_path)]
    bad = subprocess.run([*base, "--jobs", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--jobs" in bad.stderr, bad.stderr
    res = subprocess.run([*base, "--jobs", "4", "--devices", "cpu", "--deadline-s", "200", "--corpus",
                          "no-such-corpus"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "no run finished" in res.stderr, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["finished"] == 0 and len(out["unfinished"]) == 4  # the cpu plan's first stage: 2 lrs x 2 schedules
    for name in out["unfinished"]:
        assert "no-such-corpus" in (tmp_path / f"{name}.log").read_text()


def _leaves(cmd, path: tuple[str, ...] = ()):
    """The argv prefix of every command under `cmd` (groups walked)."""
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield path


def test_every_help_shows_its_defaults_bare():
    """A generated option's default is shown as click shows a plain one, `[default: 20]`, never in parentheses
    (`[default: (20)]`, click's spelling of a `show_default` text): every command of the app, and `train --help` as
    a real process; the hidden `train --fleet-sync` and `--config` stay out of it."""
    from typer.main import get_command

    commands = list(_leaves(get_command(app)))
    commands += [(name, *c) for name, sub in EXPERIMENTS.items() for c in _leaves(get_command(sub))]
    assert ("coordinator",) in commands and ("data", "pack") in commands and len(commands) > 20
    assert ("regime", "run") in commands and ("headline", "memory") in commands and ("zo",) in commands
    shown = {" ".join(c): _help(list(c)) for c in commands}
    assert {c: t for c, t in shown.items() if "default: (" in t} == {}
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and "--steps INTEGER optimizer steps. Bound: 1<=x<=10,000,000. [default: 300; demo " \
        "preset: 150]" in text, text
    assert "--fleet-sync" not in text and "--config" not in text


def test_every_help_lists_its_positional_arguments_under_arguments():
    """A positional argument is listed under "Arguments" with its help, never under "Options" as if it were an option
    (SettingsCommand listed `export`'s `run_dir <path>` there): every command of the app; `export`'s by the names its
    help text uses (RUN_DIR, OUT_DIR)."""
    from typer.main import get_command

    root = get_command(app)
    with_arguments = {}
    for path in _leaves(root):
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        if arguments:
            out = CliRunner(env=dict.fromkeys(UNSET)).invoke(app, [*path, "--help"], terminal_width=200).output
            listed = out.partition("\nArguments:\n")[2].partition("\nOptions:\n")[0]
            options = out.partition("\nOptions:\n")[2]
            with_arguments[" ".join(path)] = [line.split()[0] for line in listed.splitlines() if line.strip()]
            assert not any(line.split()[0] in (a.metavar, a.name, f"{a.name}...") for line in options.splitlines()
                           if line.strip() for a in arguments), out
    assert {"export", "bench serving-load"} <= set(with_arguments)
    assert with_arguments["export"] == ["RUN_DIR", "OUT_DIR"]
    text = _help(["export"])
    assert "Arguments: RUN_DIR <path> Run folder of `sparecycles train` or `sparecycles up`. [required] OUT_DIR " \
        "<path> Output folder (config.json, model.safetensors, tokenizer). [required] Options: --partial" in text, text


def test_converted_commands_parse_into_their_models():
    """`coordinator --log-level WARNING` is uvicorn's warning; `up --set`/`--optimizer-option` repeat into one tuple
    and one dict (VALUE read as JSON); `train --fleet-sync --config F` still parse, hidden; parsed only."""
    from typer.main import get_command

    from api.cli import CoordinatorOptions
    from sparecycles.up_options import UpOverrides
    from trainer.cli import FetchOptions, PackOptions
    from trainer.train_cli import TrainCommandOptions

    commands = get_command(app).commands
    values = commands["coordinator"].make_context("coordinator", ["--log-level", "WARNING", "--port", "9"]).params
    assert (values["log_level"], values["port"], values["workers"]) == ("warning", 9, None)  # unset: the model's
    assert CoordinatorOptions().model_dump() == {"host": "127.0.0.1", "port": 8787, "log_level": "info",
                                                 "access_log": False, "workers": 1, "check": False}
    up = commands["up"].make_context("up", ["--set", "lr=6e-4", "--set", "steps=5", "--optimizer-option", "s_max=8",
                                            "--optimizer-option", "start=one"]).params
    assert (up["set"], up["optimizer_option"]) == (["lr=6e-4", "steps=5"], ["s_max=8", "start=one"])
    assert UpOverrides(train_options=("lr=6e-4",), optimizer_options={"s_max": 8}).optimizer_options == {"s_max": 8}
    train = commands["train"].make_context("train", ["--fleet-sync", "--config", "c.json"]).params
    assert (train["fleet_sync"], train["config"], train["preset"]) == (True, Path("c.json"), None)
    assert TrainCommandOptions().preset == "demo" and TrainCommandOptions().coordinator is None
    assert FetchOptions().corpus_to_build == "classics-small" and FetchOptions(task="sentiment").corpus_to_build is None
    assert PackOptions().model_dump() == {"corpus": "classics-large", "data": None, "model": "gpt2-tiny",
                                          "text_field": "text", "encoding_errors": "strict", "out": Path(".data")}
