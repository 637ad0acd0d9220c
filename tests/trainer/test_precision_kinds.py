"""Each round kind's forward precision (trainer.zo.probes.KINDS[kind].precision) is the one its measurement gives:
results/h200_gpu37/precision.json (`sparecycles bench precision` on an H200) names, per kind, whether
every row of it has bf16 SNR >= SNR_BOUND; the declaration must match it. Plus the SNR arithmetic on closed forms
and the CPU rule (a CPU worker never changes dtype, so its values stay bit-equal to the trainer's)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.precision import kind_of_row, precisions, snr
from support.paths import ROOT
from trainer.zo import probes

RESULT = ROOT / "results/h200_gpu37/precision.json"


def test_declared_precision_is_the_measured_one():
    res = json.loads(RESULT.read_text())
    assert res["snr_bound"] == probes.SNR_BOUND
    measured = precisions(res)
    assert measured == res["measured_precision"]
    for kind, rule in probes.KINDS.items():
        if kind.value in measured:
            assert rule.precision == measured[kind.value], kind
    assert {k.value for k in probes.KINDS} - set(measured) == set()  # every kind was measured


def test_snr_closed_forms():
    got = snr([3.0, -4.0], [3.0, -4.0])
    assert got["snr"] == math.inf and got["rms_noise"] == 0.0
    got = snr([3.0, 4.0], [4.0, 3.0])  # noise (1, -1): rms 1; signal rms sqrt(12.5)
    assert got["snr"] == pytest.approx(math.sqrt(12.5)) and got["max_noise"] == 1.0 and got["n"] == 2
    with pytest.raises(ValueError):
        snr([], [])


def test_rows_fold_into_kinds():
    assert kind_of_row("seeded_curvature") == "seeded" and kind_of_row("eval_mixture") == "eval"
    row = {"bf16": {"snr": 20.0}}
    res = {"snr_bound": 10.0, "rows": {"seeded": row, "seeded_curvature": {"bf16": {"snr": 9.0}}, "eval": row}}
    assert precisions(res) == {"seeded": "tf32", "eval": "bf16"}


def test_forward_dtype_is_bf16_only_for_bf16_kinds_on_cuda():
    assert probes.forward_dtype("eval", "cuda:0") is torch.bfloat16
    assert probes.forward_dtype("seeded", "cuda:0") is None
    assert all(probes.forward_dtype(k, "cpu") is None for k in probes.KINDS)
    with pytest.raises(ValueError):
        probes.forward_dtype("nope", "cuda")
