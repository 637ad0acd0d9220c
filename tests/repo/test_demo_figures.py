"""The demo's figures in README.md, docs/training.md and docs/RESULTS.md are those of its recorded run.

The record, results/cpu/up_demo.json, is the summary.json a real `sparecycles up` (the demo preset) wrote at
the commit it names, plus how it was measured (`measured`: command, date, commit, machine load). Each paragraph that
states the demo's figures must state the record's: final validation losses (3 decimals), results accepted, stale,
probes/s, evaluations, wall time (seconds, or minutes rounded), so the docs never disagree with a fresh run of the same
code (the run is the same whatever the fleet's timing). A change that moves the demo's figures reruns the demo and
updates the record and these paragraphs together; tests/sparecycles/test_up.py's short run checks its own recorded figures
(`measured.short`) so such a change is caught there.
"""

from __future__ import annotations

import json
import re

import pytest

from support.paths import ROOT

RECORD = json.loads((ROOT / "results" / "cpu" / "up_demo.json").read_text())
LOSS = re.compile(r"(?<![\d.])\d{1,2}\.\d{3}(?![\d.])")  # a validation loss as the docs write it: 6.089


def _paragraph(path: str, marker: str) -> str:
    """The paragraph (blank-line separated) of ROOT/`path` holding `marker`, its lines joined."""
    text = (ROOT / path).read_text(encoding="utf-8")
    found = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if marker in " ".join(p.split())]
    assert len(found) == 1, f"{path}: {len(found)} paragraphs hold {marker!r}"
    return found[0].split("`sparecycles up --task sentiment`")[0]  # that demo is another run


PARAGRAPHS = {  # every paragraph that states the demo's figures
    "README": ("README.md", "for zocurv-line against"),
    "training what up writes": ("docs/training.md", "`sparecycles up` starts all of it on one machine"),
    "training measured": ("docs/training.md", "**The demo** (`sparecycles up`)"),
    "results": ("docs/RESULTS.md", "Backing file: `results/cpu/up_demo.json`"),
}


def _losses() -> dict[str, str]:
    return {name: f"{RECORD[name][key]:.3f}" for name in ("adamw", "zocurv-line")
            for key in ("final_val_loss",)} | {"initial": f"{RECORD['adamw']['initial_val_loss']:.3f}"}


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_record_is_a_demo_run_of_up():
    m = RECORD["measured"]
    assert RECORD["preset"] == "demo" and RECORD["steps"] == 150 and RECORD["workers"] == 2 and RECORD["reused"] == []
    assert m["command"].startswith("sparecycles up") and re.fullmatch(r"[0-9a-f]{7,40}", m["commit"])
    assert RECORD["adamw"]["initial_val_loss"] == RECORD["zocurv-line"]["initial_val_loss"]
    assert not RECORD["warnings"], RECORD["warnings"]


@pytest.mark.parametrize("where", PARAGRAPHS)
def test_every_demo_loss_in_the_docs_is_the_records(where):
    text = _paragraph(*PARAGRAPHS[where])
    losses = _losses()
    delta = f"{RECORD['zocurv-line']['final_val_loss'] - RECORD['adamw']['final_val_loss']:.3f}".lstrip("-")
    stated = set(LOSS.findall(text))
    assert stated <= {*losses.values(), delta}, (where, stated - {*losses.values(), delta}, losses)
    if where != "training what up writes":  # that one states only the time
        assert {losses["adamw"], losses["zocurv-line"]} <= stated, (where, losses)


@pytest.mark.parametrize("where", PARAGRAPHS)
def test_every_demo_fleet_figure_and_time_in_the_docs_is_the_records(where):
    text, fleet, m = _paragraph(*PARAGRAPHS[where]), RECORD["fleet"], RECORD["measured"]
    for got in re.findall(r"([\d,]+) results accepted|accepted ([\d,]+) results", text):
        assert _num("".join(got)) == fleet["results_accepted"], where
    for got in re.findall(r"([\d.]+) probes/s", text):
        assert got == f"{fleet['probes_per_s']:.2f}", where
    for got in re.findall(r"(\d+) stale", text):
        assert int(got) == fleet["results_stale"], where
    for got in re.findall(r"([\d,]+) s wall|wall ([\d,]+) s", text):
        assert _num("".join(got)) == round(RECORD["wall_s"]), where
    for got in re.findall(r"(\d+) min(?:utes)?\b", text):
        assert int(got) == round(RECORD["wall_s"] / 60), where
    for got in re.findall(r"commit ([0-9a-f]{7,40})", text):
        assert got == m["commit"], where
    for got in re.findall(r"(20\d\d-\d\d-\d\d)", text):
        assert got == m["date"][:10], where
    if where != "training what up writes":
        assert re.search(r"[\d,]+ results accepted|accepted [\d,]+ results", text), where


def test_the_short_run_recorded_beside_it_is_the_one_test_up_runs():
    """`measured.short`: tests/sparecycles/test_up.py's `up` (12 steps) at the record's commit; that test compares its run to it."""
    short = RECORD["measured"]["short"]
    up_test = (ROOT / "tests" / "sparecycles" / "test_up.py").read_text()
    assert all(f'"{a}"' in up_test for a in short["args"]), short["args"]
    assert set(short["final_val_loss"]) == {"adamw", "zocurv-line"}
