"""`bench kernels` and `bench probe` (benchmarks.cli, their options KernelsBenchOptions / ProbeBenchOptions): light
import, preset sizes, clear error without a GPU."""

import subprocess
import sys

import torch
from typer.testing import CliRunner

from support.paths import ROOT


def test_cli_module_imports_no_torch():
    code = "import sys, benchmarks.cli; assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_preset_sizes_match_published_gpt2_counts():
    from probe_kernels.bench import preset_sizes

    small, large = preset_sizes("gpt2-small"), preset_sizes("gpt2-large")
    assert (sum(small), len(small)) == (124_439_808, 148)
    assert (sum(large), len(large)) == (774_030_080, 436)


def test_bench_without_cuda_fails_with_clear_message():
    from benchmarks.cli import bench_app

    res = CliRunner().invoke(bench_app, ["kernels", "--preset", "gpt2-small", "--no-forward"])
    if torch.cuda.is_available():
        assert res.exit_code == 0, res.output
    else:
        assert res.exit_code == 2 and "needs a CUDA device" in res.output


def test_bench_rejects_unknown_preset():
    from benchmarks.cli import bench_app

    res = CliRunner().invoke(bench_app, ["kernels", "--preset", "gpt2-huge", "--no-forward"])
    assert res.exit_code == 2 and "unknown preset" in res.output


def test_bench_probe_without_cuda_or_with_an_unknown_preset_fails_clearly():
    from benchmarks.cli import bench_app

    res = CliRunner().invoke(bench_app, ["probe", "--preset", "gpt2-huge"])
    assert res.exit_code == 2
    assert ("unknown preset" if torch.cuda.is_available() else "needs a CUDA device") in res.output


def test_kernels_and_probe_options_are_their_models():
    """The flags experiments/gpu_runs/run.sh passes, generated from the models (no option declared by hand), with their bounds."""
    from benchmarks.cli import bench_app
    from benchmarks.options import KernelsBenchOptions, ProbeBenchOptions

    o = KernelsBenchOptions(preset=("gpt2-small",), forward=False)
    assert (o.dist, o.k, o.batch, o.seq_len, o.json_out) == ("gauss8", 40, 16, 1024, None)
    assert ProbeBenchOptions().preset == ("gpt2-small", "gpt2-large") and ProbeBenchOptions().cross_process
    res = CliRunner().invoke(bench_app, ["probe", "--seq-len", "2048"])
    assert res.exit_code == 2 and "--seq-len" in res.output
    res = CliRunner().invoke(bench_app, ["kernels", "--dist", "uniform"])
    assert res.exit_code == 2
