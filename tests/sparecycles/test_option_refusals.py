"""Options a newcomer found accepted, or refused late or as a traceback: each is now one line (`error: ...`) and exit
status 2 from the real `sparecycles` app, before anything starts (no worker, coordinator or Valkey runs here), and
the fix holds for every option of its kind (every comma list refuses an empty item, every CUDA device is checked
against this machine's, every model preset against the presets)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparecycles.cli import app
from support.paths import ROOT

UNSET = ("REDIS_URL", "SPARECYCLES_BLOB_DIR", "SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_COORDINATOR",
         "SPARECYCLES_ENROLLMENT_TOKEN", "SPARECYCLES_SERVING_METRICS", "SPARECYCLES_SERVING_HOLD")
NO_CUDA = r"(no CUDA device is visible here|only \d+ CUDA device\(s\) are visible)"  # a CPU host, or a GPU host
WORKER = ["worker", "--coordinator", "http://127.0.0.1:1", "--token", "t"]
DOWN = "redis://127.0.0.1:1/0"  # port 1: nothing listens, the connection is refused at once


def _refused(args: list[str]) -> str:
    """The one error line of `sparecycles ARGS`, which must exit 2."""
    if args[:1] == ["headline"]:  # the experiment's command line, `python -m experiments.headline`
        from experiments.headline.cli import headline_app

        res = CliRunner(env=dict.fromkeys(UNSET)).invoke(headline_app, args[1:])
    else:
        res = CliRunner(env=dict.fromkeys(UNSET)).invoke(app, args)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (res.exit_code, res.output)
    return lines[0]


@pytest.mark.parametrize(("args", "line"), [
    (["bench", "fleet", "--workers", "1,,2"], "error: --workers: '1,,2' has an empty item"),
    (["bench", "fleet", "--workers", "1,2,"], "error: --workers: '1,2,' has an empty item"),
    (["headline", "memory", "--shapes", "gpt2-xl,,gpt-2.7b"], "error: --shapes: 'gpt2-xl,,gpt-2.7b' has an "
     "empty item"),
    (["train", "--anytime-windows", "4,,8"], "error: --anytime-windows: '4,,8' has an empty item"),
    (["fleet", "--worker-devices", "cpu,,cpu"], "error: --worker-devices: 'cpu,,cpu' has an empty item"),
    (["bench", "fleet", "--workers", "1,0"], "error: --workers: Input should be greater than or equal to 1"),
])
def test_a_comma_list_with_an_empty_item_is_refused(args, line, tmp_path):
    args = [*args, "--folder", str(tmp_path / "fl")] if args[0] == "fleet" else args
    assert _refused(args).startswith(line)
    assert not (tmp_path / "fl").exists()


@pytest.mark.parametrize("args", [
    ["bench", "serving", "--device", "cuda:99"],
    ["bench", "serving", "--train-device", "cuda:99"],
    ["bench", "fleet", "--device", "cpu,cuda:99"],
    ["bench", "fleet", "--trainer-device", "cuda:99"],
])
def test_a_cuda_device_this_machine_lacks_is_refused_naming_its_option(args):
    import re

    assert re.fullmatch(rf"error: {args[2]} cuda:99: {NO_CUDA}.*", _refused(args))


def test_bench_serving_writes_under_runs_which_git_ignores():
    from benchmarks.serving_options import ServingBench

    out = ServingBench().out
    assert out == Path("runs/bench-serving")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(out / "serving.json")], cwd=ROOT)
    assert ignored.returncode == 0  # a user's run never overwrites results/cpu/serving/


@pytest.mark.parametrize(("args", "line"), [
    (["--preset", "nope"], "error: --preset: unknown model preset 'nope'; valid presets: gpt2-tiny, gpt2-small"),
    (["--ready-preset", "nope"], "error: --ready-preset: unknown model preset 'nope'; valid presets: gpt2-tiny"),
    (["--redis-url", "foo"], "error: --redis-url (env var: REDIS_URL): 'foo' is not a Redis URL: use "
     "redis://HOST:PORT/DB"),
    (["--redis-url", DOWN], "error: --redis-url: the Redis at 127.0.0.1:1/0 does not answer ("),
    (["--redis-url", "redis://127.0.0.1:port/0"], "error: --redis-url: the Redis at 127.0.0.1:port/0 does not answer"),
    (["--worker-cuda-graphs"], "error: --worker-cuda-graphs needs CUDA workers (--device cuda:N), got --device cpu"),
])
def test_bench_fleet_refuses_a_bad_preset_or_redis_before_any_work(args, line):
    assert _refused(["bench", "fleet", *args]).startswith(line)


def test_bench_fleet_skips_the_ready_phase_with_an_empty_preset_and_intake_checks_its_redis_too():
    from benchmarks.options import FleetBenchOptions

    assert FleetBenchOptions(ready_preset="").ready_preset == ""
    line = _refused(["bench", "intake", "--redis-url", DOWN])
    assert line.startswith("error: --redis-url: the Redis at 127.0.0.1:1/0 does not answer")


@pytest.mark.parametrize(("args", "line"), [
    (["--cuda-graphs"], "error: --cuda-graphs needs --device cuda:N (got cpu)"),
    (["--cuda-graphs", "--yield-gpu-util", "50"], "error: --yield-gpu-util and --cuda-graphs need --device cuda:N"),
    (["--teacher-pause", "5"], "error: --teacher-pause holds teacher rounds: name their queue with --teacher-queue"),
    (["--teacher-pause", "5", "--teacher-queue", "q", "--teacher-engine", "http://127.0.0.1:2"],
     "error: --teacher-pause holds rounds of the teacher loaded here; --teacher-engine answers through the engine"),
    (["--teacher-queue", ""], "error: --teacher-queue: a queue name without spaces"),
    (["--teacher-queue", "a b"], "error: --teacher-queue: a queue name without spaces"),
    (["--serving-metrics", "http://127.0.0.1:2/metrics", "--serving-gauge", ""],
     "error: --serving-gauge: String should have at least 1 character"),
])
def test_worker_refuses_a_combination_at_option_validation(args, line):
    assert _refused([*WORKER, *args]).startswith(line)


def test_worker_refuses_a_cache_or_blob_dir_that_is_a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("kept\n")
    assert _refused([*WORKER, "--cache-dir", str(path)]) == f"error: --cache-dir: {path} is a file: give a folder"
    line = _refused([*WORKER, "--blob-dir", str(path / "blobs")])
    assert line.endswith(f"{path / 'blobs'} is under {path}, a file: give a folder")
    assert path.read_text() == "kept\n"


@pytest.mark.parametrize("command", ["fleet", "up"])
def test_workers_and_worker_devices_that_disagree_are_refused(command, tmp_path):
    folder = "--folder" if command == "fleet" else "--run-dir"
    line = _refused([command, "--workers", "1", "--worker-devices", "cpu,cpu", folder, str(tmp_path / "f")])
    assert line == ("error: --workers 1 and --worker-devices cpu,cpu (2 devices) disagree: --worker-devices starts "
                    "one worker per device and replaces --workers; leave --workers out")
    assert not (tmp_path / "f").exists()


def test_workers_that_agree_with_worker_devices_or_are_left_out_are_accepted():
    from sparecycles.fleet_cli import FleetOptions
    from sparecycles.up_options import UpOptions

    for model in (FleetOptions, UpOptions):
        assert model(workers=2, worker_devices="cpu,cpu").worker_devices == "cpu,cpu"
        assert model(worker_devices="cpu,cpu,cpu").workers == 2  # the default, replaced by the three devices
