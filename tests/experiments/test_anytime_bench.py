"""The anytime benchmark's pure helpers (WSD schedule, anytime speedup) and a tiny CPU dry run of the driver
and its report (the H200 run itself is experiments/anytime/run.sh)."""

from __future__ import annotations

import json

import pytest

import trainer.data.corpus as corpus_mod
from experiments.anytime.bench import main, speedup, wsd_lr
from experiments.anytime.report import main as report_main


def test_wsd_schedule_closed_form():
    kw = dict(lr=1.0, warmup=10, total=100, decay_frac=0.2)
    assert wsd_lr(0, **kw) == pytest.approx(0.1) and wsd_lr(9, **kw) == 1.0
    assert wsd_lr(50, **kw) == 1.0 and wsd_lr(79, **kw) == 1.0
    assert wsd_lr(80, **kw) == 1.0 and wsd_lr(90, **kw) == pytest.approx(0.5)
    assert wsd_lr(99, **kw) == pytest.approx(0.05)  # the last update's lr; 0 would be a wasted step


def test_speedup_interpolates_the_raw_curve():
    raw = [(0, 10.0), (100, 5.0), (200, 4.0), (300, 3.0)]
    assert speedup(raw, 100, 4.5) == pytest.approx(150 / 100)  # halfway between steps 100 and 200
    assert speedup(raw, 100, 5.0) == pytest.approx(1.0)
    assert speedup(raw, 200, 2.0) is None  # raw never gets there
    assert speedup(raw, 200, 6.0) == pytest.approx(80 / 200)  # served worse than raw: < 1


def test_cpu_dry_run_writes_json_png_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(corpus_mod.CORPORA, "test-milton-select", ("milton",))
    monkeypatch.setattr(corpus_mod, "SELECT_CORPORA", corpus_mod.SELECT_CORPORA | {"test-milton-select"})
    res = main(["--out", str(tmp_path), "--preset", "gpt2-tiny", "--corpus", "test-milton-select", "--steps", "8",
                "--batch-size", "2", "--seq-len", "16", "--device", "cpu", "--eval-every", "4", "--eval-batches", "1",
                "--select-batches", "1", "--k", "3", "--publish-every", "1", "--ref-fracs", "0.5", "--quad-dim", "1"])
    assert [e["step"] for e in res["evals"]] == [0, 4, 8]
    assert [r["steps"] for r in res["references"]] == [4]
    assert res["references"][0]["decay_start"] == 3  # 20% of a 4-step run, rounded: the last step decays
    raw = [(e["step"], e["raw_val"]) for e in res["evals"]]
    for e in res["evals"][1:]:  # the speedup is where the raw curve (linear between evaluations) meets served_val
        if e["speedup"] is None:
            assert all(v > e["served_val"] for _, v in raw) and e["speedup_lower_bound"] == 8 / e["step"]
        else:
            at = e["speedup"] * e["step"]
            (s0, v0), (s1, v1) = next((a, b) for a, b in zip([raw[0], *raw], raw) if a[0] <= at <= b[0])
            v_at = v0 if s1 == s0 else v0 + (v1 - v0) * (at - s0) / (s1 - s0)
            assert v_at == pytest.approx(e["served_val"], abs=1e-9) or (s1 == s0 and v1 <= e["served_val"])
    assert (tmp_path / "anytime.png").stat().st_size > 0
    report_main([str(tmp_path / "anytime.json"), "--out", str(tmp_path / "results")])
    table = (tmp_path / "results" / "table.md").read_text()
    assert "| 4 |" in table and "annealed at" in table
    assert json.loads((tmp_path / "results" / "anytime.json").read_text())["benchmark"] == "anytime"
