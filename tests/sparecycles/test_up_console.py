"""`sparecycles up` ends with one line per run, serving's line with `--serving`, and the pointer to summary.json
(sparecycles.up_summary.end_lines), here on the recorded demo's summary.json; tests/sparecycles/test_up.py checks a real run's last lines."""

from __future__ import annotations

import json

from sparecycles.up_summary import end_lines
from support.paths import ROOT

DEMO = json.loads((ROOT / "results" / "cpu" / "up_demo.json").read_text())


def test_up_ends_with_a_line_per_run_and_where_summary_json_is(tmp_path):
    a, z, fleet = DEMO["adamw"], DEMO["zocurv-line"], DEMO["fleet"]
    assert end_lines(DEMO, tmp_path) == [
        f"adamw: val loss {a['initial_val_loss']:.4f} -> {a['final_val_loss']:.4f} after 150 steps",
        f"zocurv-line: val loss {z['initial_val_loss']:.4f} -> {z['final_val_loss']:.4f} after 150 steps; fleet of 2: "
        f"{fleet['results_accepted']:.0f} results accepted, 0 stale, {fleet['probes_per_s']:.2f} probes/s",
        f"every figure: {tmp_path / 'summary.json'} (plot loss_curves.png, {DEMO['disk_mb']['total']:.1f} MB on disk, "
        f"wall {DEMO['wall_s']:.0f} s)"]


def test_a_reused_sentiment_run_and_a_serving_run_say_so(tmp_path):
    summary = {**DEMO, "reused": ["adamw"], "fleet": {},
               "adamw": {**DEMO["adamw"], "final_val_acc": 0.8125}}
    first, second = end_lines(summary, tmp_path)[:2]
    assert first.endswith(", val accuracy 0.812 after 150 steps (reused)") and second.endswith("after 150 steps")
    serving = {"requests_planned": 4, "requests_sent": 4, "answered": 4, "failed": 0, "rate_per_s": 0.5,
               "load_ran_s": 9.0, "load_planned_s": 7.0, "load_ended_by": "the runs ended",
               "ttft_s": {"p50": 0.2, "p95": 0.3}, "e2e_s": {"p50": 1.0, "p95": 1.5},
               "alone": {"answered": 6, "ttft_s": {"p50": 0.1, "p95": 0.2}, "e2e_s": {"p50": 0.9, "p95": 1.2}},
               "p95_vs_alone": {"ttft_s": 1.5, "e2e_s": 1.25},
               "workers_total": {"yielded_s": 2.0, "engine_idle_s": 40.0, "idle_used_s": 10.0, "idle_used_share": 0.25}}
    lines = end_lines({**DEMO, "serving": serving}, tmp_path)
    assert len(lines) == 4 and lines[2] == (
        "serving: 4/4 requests answered (0 failed); TTFT p50/p95 0.20/0.30 s, end to end 1.00/1.50 s; p95 1.25x end "
        "to end, 1.50x TTFT, of the engine alone (1.20/0.20 s, 6 requests); workers yielded 2.0 s, used 10.0 of the "
        "engine's 40.0 idle s (25%)")
