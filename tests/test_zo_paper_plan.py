"""Splitting `bench zo --regime paper` over device calls: share renormalisation, per-arm fp32 matmul, and
merging an earlier call's summary (A3w's lr and the drift from an included A1), on a tiny CPU classifier."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from benchmarks.zo_paper_plan import arm_seconds, canonical_order, merge_include, paper_arms, parse_matmul
from trainer.zo.paper import PAPER


def test_shares_renormalise_over_the_arms_run_now():
    every = paper_arms(100.0)
    assert sum(a["share"] for a in every) == pytest.approx(1.0)
    assert every[0]["name"] == "A1" and every[0]["time_s"] == pytest.approx(100 * 24 / 91)  # weights sum to 91
    two = paper_arms(100.0, ("A3", "A1"))  # canonical order, shares 0.24 : 0.11
    assert [a["name"] for a in two] == ["A1", "A3"]
    assert [a["time_s"] for a in two] == pytest.approx([100 * 24 / 35, 100 * 11 / 35])
    assert paper_arms(50.0, ("A1",))[0]["time_s"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="arms are"):
        paper_arms(1.0, ("A9",))
    # an arm's seconds at its start: what is left times its share of the shares left
    assert arm_seconds(0.24, 0.35, 70.0) == pytest.approx(48.0)
    assert arm_seconds(0.11, 0.11, 9.5) == pytest.approx(9.5)  # the last arm gets what is left
    assert arm_seconds(0.5, 1.0, -3.0) == 0.0
    assert canonical_order(["A6-5e-05", "A2", "zz", "A1"]) == ["A1", "A2", "A6-5e-05", "zz"]


def test_fp32_matmul_per_arm():
    names = ["A1", "A2", "A3", "A5-1e-05"]
    assert parse_matmul("highest", names) == dict.fromkeys(names, "highest")
    assert parse_matmul("high,A1=highest,A3=highest", names) == {"A1": "highest", "A2": "high", "A3": "highest",
                                                                  "A5-1e-05": "high"}
    assert parse_matmul("A5-1e-05=high", names)["A1"] == "highest"  # no bare mode: highest
    for bad in ("medium", "high,highest", "A1=tf32", "=high"):
        with pytest.raises(ValueError):
            parse_matmul(bad, names)


def test_merge_keeps_included_arms_unless_rerun():
    inc = {"arms": {"A1": {"x": 1}, "A2": {"x": 2}}, "ledger_A1": [[[1], [0.1], 1e-4]], "drift": {"steps": 1},
           "meta": {"calls": [{"arms": ["A1", "A2"]}]}}
    m = merge_include(inc, ["A2", "A3"])
    assert m["arms"] == {"A1": {"x": 1}} and m["ledger_A1"] == inc["ledger_A1"] and m["drift"] == {"steps": 1}
    assert m["calls"] == [{"arms": ["A1", "A2"]}]
    rerun = merge_include(inc, ["A1"])
    assert set(rerun["arms"]) == {"A2"} and rerun["ledger_A1"] is None and rerun["drift"] is None
    assert merge_include(None, ["A1"]) == {"arms": {}, "ledger_A1": None, "drift": None, "calls": []}


def test_two_calls_merge_into_one_summary(tmp_path):
    """Call 1 runs A1 only (no drift); call 2 runs A2 and A3w, including call 1: A3w's lr comes from the
    included A1's mean w, the drift replays the included ledger, A1 is carried over unchanged, and the table
    lists all three in the canonical order."""
    from benchmarks.zo_paper import paper_comparison
    from tests.test_zo_paper import _Tiny, _tiny_data

    data = _tiny_data()
    calls = []
    s1 = paper_comparison(tmp_path / "c1", lambda dt: _Tiny().to(dt), data, total_s=60.0, arms=("A1",),
                          drift=False, iters_cap=2, set_matmul=calls.append, matmul={"A1": "highest"})
    assert calls == ["highest"] and s1["arms"]["A1"]["fp32_matmul"] == "highest"
    assert s1["arms"]["A1"]["iterations"] == 2 and "drift" not in s1 and len(s1["ledger_A1"]) == 2
    assert all(len(sd) == 40 and len(c) == 40 and e == PAPER.eps for sd, c, e in s1["ledger_A1"])
    inc = json.loads((tmp_path / "c1" / "paper_summary.json").read_text())
    s2 = paper_comparison(tmp_path / "c2", lambda dt: _Tiny().to(dt), data, total_s=60.0, arms=("A3w", "A2"),
                          include=inc, iters_cap=1, set_matmul=calls.append, matmul={"A2": "high"})
    assert calls == ["highest", "high", "highest"]  # A2 high, A3w the default
    assert [r["arm"] for r in s2["table"]] == ["A1", "A2", "A3w"]
    assert s2["arms"]["A1"] == inc["arms"]["A1"]
    ws = [x["w_mean"] for x in inc["arms"]["A1"]["log"]]
    assert s2["arms"]["A3w"]["lr"] == pytest.approx(PAPER.lr * sum(ws) / len(ws))
    assert s2["drift"]["steps"] == 2 and s2["drift"]["cycles"] == 2 * 40
    assert [c["arms"] for c in s2["meta"]["calls"]] == [["A1"], ["A2", "A3w"]]
    # the arms run now share the budget: A2 (0.16) and A3w (0.11) of 60 s
    assert s2["arms"]["A2"]["time_s"] == pytest.approx(60 * 16 / 27, rel=0.05)
    with pytest.raises(ValueError, match="A3w"):
        paper_comparison(tmp_path / "c3", lambda dt: _Tiny().to(dt), data, total_s=1.0, arms=("A3w",))


def test_cli_checks_include_and_per_arm_matmul(tmp_path):
    from benchmarks.cli import bench_zo

    app = typer.Typer()
    app.command()(bench_zo)
    has_a1 = tmp_path / "a1.json"
    has_a1.write_text(json.dumps({"arms": {"A2": {}}}))
    base = ["--part", "sentiment", "--out", str(tmp_path / "o"), "--regime", "paper", "--model", "smollm2"]
    for args, hint in ((["--arms", "A3w", "--include", str(has_a1)], "--arms"),  # that summary has no A1
                       (["--include", str(tmp_path / "missing.json")], "--include"),
                       (["--fp32-matmul", "high,A1=tf32"], "--fp32-matmul"),
                       (["--arms", "A1,A9"], "--arms")):
        res = CliRunner().invoke(app, [*base, *args])
        assert res.exit_code == 2, res.output
        assert hint in res.output
