"""experiments.kd.report: the steps at which a taught run reaches CE-only's final loss, from run folders."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.kd.report import main, step_reaching


def _run(d: Path, curve: list[tuple[int, float]], kd: dict | None, phases: dict) -> None:
    d.mkdir(parents=True)
    lines = [json.dumps({"step": s, "val_loss": v}) for s, v in curve]
    lines.append(json.dumps({"step": curve[-1][0], "loss": curve[-1][1], **(kd or {})}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "summary.json").write_text(json.dumps({"steps": curve[-1][0], "kd": kd,
                                                "time_ledger": {"phases_s": phases}}))


def test_step_reaching_interpolates_between_bracketing_evaluations():
    curve = [(0, 10.0), (100, 6.0), (200, 5.0), (300, 4.0)]
    assert step_reaching(curve, 5.5) == 150.0  # halfway from 6.0 (step 100) to 5.0 (step 200)
    assert step_reaching(curve, 5.0) == 200.0
    assert step_reaching(curve, 3.9) is None
    assert step_reaching([(0, 3.0), (10, 2.0)], 4.0) == 0.0


def test_report_from_run_folders(tmp_path):
    _run(tmp_path / "ce-300", [(0, 10.0), (100, 6.0), (200, 5.0), (300, 4.5)], None, {"step": 30.0, "kd": 0.0})
    _run(tmp_path / "kd-300", [(0, 10.0), (100, 5.0), (200, 4.0), (300, 3.5)],
         {"kd_taken_steps": 300, "kd_missing_steps": 0, "kd_bytes_up": 3000, "kd_bytes_down": 300_000},
         {"step": 30.0, "kd": 3.0})
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    row = json.loads((tmp_path / "out/kd_report.json").read_text())["horizons"][0]
    assert row["kd_step_reaching_ce_final"] == 150.0  # 4.5 halfway between 5.0 (100) and 4.0 (200)
    assert row["steps_ratio"] == 0.5
    assert (row["bytes_up_per_step"], row["bytes_down_per_step"]) == (10, 1000)
    assert row["step_time_ratio"] == 1.1
    assert (tmp_path / "out/kd_curves.png").stat().st_size > 10_000


def test_every_taught_variant_beside_ce_is_a_row(tmp_path):
    """KD_VARIANTS runs (e.g. k32-300 beside kd-300): one row each against the horizon's CE run, kd first; the
    table gives the ratio to three places (0.605 is over a 0.6 goal; two places would print 0.60)."""
    _run(tmp_path / "ce-300", [(0, 10.0), (100, 6.0), (200, 5.0), (300, 4.5)], None, {"step": 30.0})
    _run(tmp_path / "kd-300", [(0, 10.0), (100, 5.0), (200, 4.0), (300, 3.5)], {}, {"step": 30.0})
    _run(tmp_path / "k32-300", [(0, 10.0), (100, 6.0), (200, 4.49), (300, 3.5)], {}, {"step": 30.0})
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out/kd_report.json").read_text())["horizons"]
    assert [(r["variant"], r["steps_ratio"]) for r in rows] == [("kd", 0.5), ("k32", 0.664)]  # 100 + 100 * 1.5 / 1.51 = 199.3 of 300
    assert "| 300 | k32 | 4.5000 | 3.5000 | 199 | 0.664× |" in (tmp_path / "out/table.md").read_text()


def test_report_refuses_a_folder_without_pairs(tmp_path, capsys):
    (tmp_path / "ce-10").mkdir()
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no ce-N and kd-N" in capsys.readouterr().out
