"""The bench commands' typed options (benchmarks.options, and the experiments' own: experiments/zo, headline,
regime): the rules between options as model validators, without the CLI, and the generated commands keeping every
flag that docs/RESULTS.md and the experiments' run scripts use."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.main import get_command

from benchmarks.cli import bench_app
from benchmarks.options import FleetBenchOptions, IntakeBenchOptions, PrecisionOptions
from experiments.headline.cli import headline_app
from experiments.regime.cli import regime_app
from experiments.zo.cli import ZoBenchOptions
from experiments.zo.cli import app as zo_app

# The experiments' command lines (`python -m experiments.NAME`), not the product's `sparecycles bench`.
EXPERIMENT_APPS = {"zo": zo_app, "headline": headline_app, "regime": regime_app}


def test_paper_regime_rules_are_validators():
    with pytest.raises(ValidationError, match="--model: --regime paper runs on smollm2 only"):
        ZoBenchOptions(regime="paper")
    with pytest.raises(ValidationError, match="give --include"):
        ZoBenchOptions(regime="paper", model="smollm2", resume=True)
    o = ZoBenchOptions(regime="paper", model="smollm2", resume=True, include=Path("a.json"), arms=" A1, A3w ,")
    assert o.arm_names == ("A1", "A3w") and ZoBenchOptions().arm_names is None
    with pytest.raises(ValidationError, match="budget"):
        ZoBenchOptions(budget=2)


def test_fleet_options_derive_the_batches_and_worker_arguments():
    o = FleetBenchOptions()
    assert (o.workers, o.batch, o.train_batch, o.worker_args) == ((1, 2, 4), (4, 64), (4, 64),
                                                                  ("--tf32-attention", "auto"))
    o = FleetBenchOptions(batch_size=8, seq_len=32, train_seq_len=128, tf32_attention="bf16")
    assert o.train_batch == (8, 128) and o.worker_args == ("--tf32-attention", "bf16")
    graphs = FleetBenchOptions.model_construct(device="cuda:0", worker_cuda_graphs=True)  # no CUDA device needed
    assert graphs.worker_args == ("--cuda-graphs", "--tf32-attention", "auto")
    with pytest.raises(ValidationError, match="--worker-cuda-graphs needs CUDA workers"):
        FleetBenchOptions(worker_cuda_graphs=True)
    for bad in ({"workers": ()}, {"workers": (0,)}, {"kind": "probe"}, {"blob_path": "nfs"},
                {"tf32_attention": "fp16"}, {"seeds_per_task": 257}):
        with pytest.raises(ValidationError):
            FleetBenchOptions(**bad)
    assert IntakeBenchOptions(mode="store").modes == ("store",) and IntakeBenchOptions().modes == ("http", "store")


def _flags(name: str) -> set[str]:
    first, *rest = name.split()
    cmd = get_command(EXPERIMENT_APPS[first]) if first in EXPERIMENT_APPS else get_command(bench_app).commands[first]
    for part in rest:
        cmd = cmd.commands[part]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize(("name", "flags"), [
    ("fleet", "--workers --preset --seeds --seeds-per-task --batch-size --seq-len --threads --ready-preset "
              "--redis-url --json --device --trainer-device --compare-seeds --interval --train-batch-size "
              "--train-seq-len --json-out --blob-path --kind --worker-cuda-graphs --tf32-attention"),
    ("zo", "--part --out --device --steps --probes --k --budget --lrs --seed --methods --model --head-init --evals "
           "--backprop-steps --backprop-lr --regime --arms --time-budget --fp32-matmul --include --resume --shares "
           "--drift --no-drift --iters-cap --end-by"),
    ("precision", "--preset --batch-size --seq-len --steps --seeds --batches --corpus --device --json-out"),
    ("intake", "--workers --results --batch --mode --rate --redis-url --coordinators --json"),
    ("data-pack", "--size-mb --model --workdir --out"),
    ("headline memory", "--device --shapes --seq-len --json-out"),
    ("headline report", "--out"),
    ("serving", "--requests --rate --hold --control-interval --serving-interval --signal --nice --sched-idle --seed "
                "--blocks --probes --train-batch-size --train-seq-len --device --train-device --threads --engine "
                "--standin-config --standin-tokenizer --standin-dtype --out --redis-url"),
    ("serving-load", "--requests --rate --seed --json-out"),
    ("regime run", "--plan --out --jobs --devices --deadline-s --batch-size --seq-len --corpus --model "
                   "--micro-batch-size"),  # experiments/regime/run.sh's, its EXTRA's and docs/training.md's
    ("kernels", "--preset --dist --k --batch --seq-len --forward --no-forward --json-out"),
    ("probe", "--preset --batch --seq-len --parity-seeds --cuda-graphs --no-cuda-graphs --cross-process "
              "--no-cross-process --json-out"),
])
def test_generated_commands_keep_every_flag(name, flags):
    assert set(flags.split()) <= _flags(name)


def test_defaults_are_the_models(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert PrecisionOptions().model_dump() == {
        "preset": "gpt2-small", "batch_size": 16, "seq_len": 512, "steps": 60, "seeds": 8, "batches": 2,
        "corpus": "classics-small", "device": "cuda:0", "json_out": None}
    assert FleetBenchOptions().redis_url == "redis://127.0.0.1:6379/0"


def _own_options(cmd) -> list[str]:
    """A command's options that no options model generated: those its callback declares itself (typer.Option)."""
    generated = {n for _, names in getattr(cmd.callback, "sections", ()) for n in names}
    return [p.name for p in cmd.params if p.param_type_name == "option" and p.name not in generated]


def _leaves(cmd, name: str = ""):
    """(name, command) of every command under `cmd`, groups walked ("regime run")."""
    if hasattr(cmd, "commands"):  # a group (typer vendors its own click: no isinstance against click.Group)
        for n, c in cmd.commands.items():
            yield from _leaves(c, f"{name} {n}".strip())
    else:
        yield name, cmd


# Commands whose options are still hand-declared (typer.Option in the callback), by name: none since every command
# was converted. A new hand-declared option, or a command that passes its argv through, fails the test below.
NOT_YET_TYPED: dict[str, list[str]] = {}


def test_every_command_takes_its_options_from_typed_models():
    """House rule: a command's options come from its typed model (trainer.cli_settings), none hand-declared, and no
    command passes unparsed arguments through (as `bench regime` once did to the regime plan's own parser, with no
    --help, defaults or bounds of its own): every command of the `sparecycles` app and of the experiments' command
    lines, groups walked."""
    from sparecycles.cli import app

    leaves = dict(_leaves(get_command(app)))
    for name, sub in EXPERIMENT_APPS.items():
        leaves.update(_leaves(get_command(sub), name) if name != "zo" else [("zo", get_command(sub))])
    assert {"regime run", "regime report", "headline report", "zo", "kd fill", "bench serving-load", "up"} <= set(leaves)
    passed_through = [n for n, c in leaves.items() if c.allow_extra_args or c.ignore_unknown_options]
    assert passed_through == []
    own = {n: _own_options(c) for n, c in leaves.items()}
    assert {n: o for n, o in own.items() if o} == NOT_YET_TYPED


def test_bench_serving_redis_url_is_its_models_option_read_from_redis_url_too(monkeypatch):
    """`bench serving --redis-url` is ServingBench.redis_url, bounds and env var included: REDIS_URL is read when the
    option is not given, a URL that is no Redis URL is refused naming the option, and serving.json never holds it."""
    from typer.testing import CliRunner

    from benchmarks.serving_options import ServingBench
    from sparecycles.cli import app

    monkeypatch.delenv("REDIS_URL", raising=False)
    assert ServingBench().redis_url == "redis://127.0.0.1:6379/0"
    with pytest.raises(ValidationError, match="is not a Redis URL"):
        ServingBench(redis_url="http://x")
    cmd = get_command(bench_app).commands["serving"]
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6390/3")
    # parsed only: nothing starts
    assert cmd.make_context("serving", []).params["redis_url"] == "redis://127.0.0.1:6390/3"
    assert cmd.make_context("serving", ["--redis-url", "redis://h:1/0"]).params["redis_url"] == "redis://h:1/0"
    res = CliRunner().invoke(app, ["bench", "serving", "--redis-url", "foo"])
    assert res.exit_code == 2 and res.output.startswith(  # refused before anything starts
        "error: --redis-url (env var: REDIS_URL): 'foo' is not a Redis URL"), res.output


def test_bench_serving_refuses_requests_that_do_not_fill_whole_blocks():
    """Every block sends every arm the same requests: --requests 10 --blocks 4 sent 8 per arm and 5 over 6 blocks sent
    6, neither said. Now refused, naming both options and a count that fits."""
    from benchmarks.serving_options import ServingBench

    with pytest.raises(ValidationError, match=r"--requests 10 is not a multiple of --blocks 4 .*--requests 8"):
        ServingBench(requests=10, blocks=4)
    with pytest.raises(ValidationError, match=r"--requests 5 is not a multiple of --blocks 6 .*--requests 6"):
        ServingBench(requests=5, blocks=6)
    assert ServingBench(requests=36, blocks=6).requests == 36
