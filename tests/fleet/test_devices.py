"""fleet.devices.place: where `up` puts the trainer and its workers (pure; CUDA counts passed in)."""

from __future__ import annotations

import pytest

from fleet.devices import Placement, place


def test_gpus_auto_puts_the_trainer_first_and_a_worker_on_each_other_gpu():
    assert place(device=None, worker_devices=None, gpus="auto", workers=2, n_cuda=8) == Placement(
        "cuda:0", tuple(f"cuda:{i}" for i in range(1, 8)))
    one = place(device=None, worker_devices=None, gpus="auto", workers=2, n_cuda=1)
    assert one.trainer == "cuda:0" and one.workers == ("cuda:0",) and "share" in one.note


def test_explicit_devices_and_the_cpu_default():
    p = place(device="cuda:0", worker_devices="cuda:1, cuda:2", gpus=None, workers=5, n_cuda=3)
    assert p == Placement("cuda:0", ("cuda:1", "cuda:2"))
    assert place(device="cuda", worker_devices="cuda:0", gpus=None, workers=1, n_cuda=1).note  # shared
    assert place(device=None, worker_devices=None, gpus=None, workers=3, n_cuda=0) == Placement("cpu", ("cpu",) * 3)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"gpus": "auto"}, "no CUDA device is visible"),
    ({"device": "cuda:0"}, "no CUDA device is visible"),
    ({"worker_devices": "cuda:1"}, "no CUDA device is visible"),
    ({"gpus": "2"}, "takes 'auto'"),
    ({"device": "gpu0"}, "not a torch device"),
    ({"worker_devices": ","}, "at least one device"),
])
def test_bad_placements_are_refused_with_the_option_named(kw, msg):
    args = {"device": None, "worker_devices": None, "gpus": None, "workers": 2, "n_cuda": 0, **kw}
    with pytest.raises(ValueError, match=msg):
        place(**args)
    with pytest.raises(ValueError, match="only 2 CUDA"):
        place(device="cuda:2", worker_devices=None, gpus=None, workers=1, n_cuda=2)
    with pytest.raises(ValueError, match="leave out"):
        place(device="cuda:0", worker_devices=None, gpus="auto", workers=1, n_cuda=2)


def test_up_refuses_gpus_without_cuda_before_starting_anything(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "up", "--gpus", "auto", "--run-dir",
                          str(tmp_path / "u"), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device is visible" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "u").exists()  # nothing started, no folder made
    # --workers beside --gpus auto: refused by the options' validation (UpOptions), naming both, before any device
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "up", "--gpus", "auto", "--workers", "3",
                          "--run-dir", str(tmp_path / "u"), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--gpus auto and --workers 3 conflict" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "u").exists()
