"""`python -m experiments.zo` option checks: every bad option fails before any benchmark runs."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from experiments.zo.cli import bench_zo

app = typer.Typer()
app.command()(bench_zo)


@pytest.mark.parametrize(("args", "hint"), [
    (["--methods", "foo"], "--methods"),
    (["--methods", ","], "--methods"),
    (["--head-init", "bar"], "--head-init"),
    (["--lrs", "abc"], "--lrs"),
    (["--lrs", "1e-5,2"], "--lrs"),
    (["--model", "gpt2"], "--model"),
    (["--model", "smollm2", "--head-init", "linear-probe"], "--head-init"),  # SmolLM2 starts from its prompt
    (["--head-init", "prompt"], "--head-init"),  # MiniLM has a head to start
    (["--methods", "mezo,1.5spsa", "--k", "4", "--budget", "8"], "--budget"),  # 1.5-SPSA needs 9 per step
    (["--device", "bogus"], "--device"),
    (["--device", "mps"], "--device"),
])
def test_bad_sentiment_options_fail_before_the_lm_part_runs(tmp_path, args, hint):
    # --part all runs the (minutes-long) lm part first: the sentiment options must be checked before it.
    res = CliRunner().invoke(app, ["--part", "all", "--out", str(tmp_path / "out"), *args])
    assert res.exit_code == 2, res.output
    assert hint in res.output
    assert not (tmp_path / "out").exists()


def test_a_folder_of_another_models_runs_is_refused_before_running(tmp_path):
    """The summary refuses a folder mixing models; the CLI checks before the sweep instead of after it."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    (out / "sentiment_runs-mezo-lr1e-05.json").write_text(json.dumps({"meta": {"model": "minilm"}, "runs": []}))
    res = CliRunner().invoke(app, ["--part", "all", "--model", "smollm2", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "--out" in res.output and "minilm" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["sentiment_runs-mezo-lr1e-05.json"]
