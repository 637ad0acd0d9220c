"""End to end: `sparecycles up` on the real corpus (embedded Valkey, coordinator, 2 workers, trainer)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from support.paths import ROOT
from support.processes import processes_of, start_up

DEMO_RECORD = ROOT / "results" / "cpu" / "up_demo.json"
SHORT_ARGS = ("--steps", "12", "--curvature-interval", "4", "--no-export", "--eval-windows", "subset")
pytestmark = pytest.mark.slow  # end to end: `sparecycles up` starts Valkey, a coordinator, 2 workers, the trainer


def _last_lines(out: bytes, n: int) -> list[str]:
    return out.decode().rstrip("\n").splitlines()[-n:]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.parent.name in ("adamw", "zocurv-line")}


@pytest.mark.timeout(1800)  # three invocations of `up`; the first trains both runs
def test_up_runs_both_curves_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "up"
    proc = start_up(run_dir, *SHORT_ARGS)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out.decode()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["optimizer"] == "zocurv-line" and summary["steps"] == 12
    assert summary["redis"].startswith("embedded Valkey")
    assert summary["fleet"]["workers"] == 2
    assert summary["fleet"]["tasks_published"] >= 1  # the ZO-Curv rounds reached the Celery queue
    for name in ("adamw", "zocurv-line"):
        recs = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs if "loss" in r] == list(range(1, 13))
        vals = [r["val_loss"] for r in recs if "val_loss" in r]
        assert vals[-1] < vals[0] - 1.0, (name, vals)
        assert summary[name]["final_val_loss"] == pytest.approx(vals[-1])
    assert (run_dir / "loss_curves.png").stat().st_size > 20_000
    assert not (run_dir / "adamw" / "export").exists() and not (run_dir / "zocurv-line" / "export").exists()
    assert processes_of(run_dir) == []
    # zocurv-line probes at steps 4 and 8 (not 0: it probes along the step before): trainer.preflight's count
    zo = [json.loads(line) for line in (run_dir / "zocurv-line" / "metrics.jsonl").read_text().splitlines()]
    refreshes = [r for r in zo if "curv_dropped_rounds" in r]
    assert [r["step"] for r in refreshes] == [5, 9]
    # 12 steps > the interval: no warning that no round is due (a fleet slower than the interval, as on a loaded
    # machine, is flagged by its own warning: sparecycles.up.unfolded_warning)
    assert summary["reused"] == [] and not any("run too short" in w for w in summary["warnings"])
    assert not (run_dir / "blobs").exists() and not (run_dir / "valkey").exists()  # no --keep-blobs
    assert summary["disk_mb"]["total"] > summary["disk_mb"]["adamw"] > 1
    # The console ends with one line per run and the pointer to summary.json, not the summary itself
    assert _last_lines(out, 3) == [
        f"adamw: val loss {summary['adamw']['initial_val_loss']:.4f} -> {summary['adamw']['final_val_loss']:.4f} "
        "after 12 steps",
        f"zocurv-line: val loss {summary['zocurv-line']['initial_val_loss']:.4f} -> "
        f"{summary['zocurv-line']['final_val_loss']:.4f} after 12 steps; fleet of 2: "
        f"{summary['fleet']['results_accepted']:.0f} results accepted, {summary['fleet']['results_stale']:.0f} stale, "
        f"{summary['fleet']['probes_per_s']:.2f} probes/s",
        f"every figure: {run_dir / 'summary.json'} (plot loss_curves.png, {summary['disk_mb']['total']:.1f} MB on "
        f"disk, wall {summary['wall_s']:.0f} s)"]
    assert '"disk_mb"' not in out.decode()

    # The same command again: both finished runs reused, no service started, every file of both runs kept.
    files, log_size = _files(run_dir), (run_dir / "logs" / "coordinator.log").stat().st_size
    proc = start_up(run_dir, "--steps", "12", "--curvature-interval", "4", "--eval-windows", "subset")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out.decode()[-3000:]
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["reused"] == ["adamw", "zocurv-line"] and again["redis"] == "not started (both runs reused)"
    assert {k: again[k] for k in ("adamw", "zocurv-line", "fleet")} == {k: summary[k] for k in ("adamw", "zocurv-line", "fleet")}
    assert [line.split(" after ")[1] for line in _last_lines(out, 3)[:2]] == [
        "12 steps (reused)", f"12 steps (reused); fleet of 2: {summary['fleet']['results_accepted']:.0f} results "
        f"accepted, {summary['fleet']['results_stale']:.0f} stale, {summary['fleet']['probes_per_s']:.2f} probes/s"]
    assert _files(run_dir) == files and (run_dir / "logs" / "coordinator.log").stat().st_size == log_size

    # Other --steps into the same folder: refused before anything starts, naming the difference.
    proc = start_up(run_dir, "--steps", "13", "--curvature-interval", "4", "--eval-windows", "subset")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "steps: 12 -> 13" in out.decode() and "--overwrite" in out.decode(), out.decode()
    assert _files(run_dir) == files and json.loads((run_dir / "summary.json").read_text()) == again

    # The demo's record (results/cpu/up_demo.json, which the docs' figures are checked against) holds this
    # short run's figures at the same commit: a change that moves them moves the demo's too (tests/repo/test_demo_figures.py)
    short = json.loads(DEMO_RECORD.read_text())["measured"]["short"]
    assert short["args"] == list(SHORT_ARGS)
    for name in ("adamw", "zocurv-line"):
        assert summary[name]["final_val_loss"] == pytest.approx(short["final_val_loss"][name], abs=5e-3), (
            f"{name}'s final validation loss moved from the recorded {short['final_val_loss'][name]}: the code changed "
            "the demo's figures too; rerun the demo and update results/cpu/up_demo.json and the docs")


def test_invalid_option_fails_before_any_child_starts(tmp_path):
    for args, words in [(["--optimizer", "adamw"], ("--optimizer 'adamw'", "baseline")),
                        (["--seq-len", "300"], ("--seq-len 300", "256"))]:
        run_dir = tmp_path / "bad"
        proc = start_up(run_dir, *args)
        out = proc.communicate(timeout=300)[0].decode()
        assert proc.returncode == 2 and all(w in out for w in words) and "Traceback" not in out, out
        assert not run_dir.exists()  # no folder, so no log of any child: nothing was started


def test_ctrl_c_stops_every_process(tmp_path):
    run_dir = tmp_path / "up-int"
    proc = start_up(run_dir, "--steps", "500")
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "adamw" / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and metrics.stat().st_size > 0):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        started = processes_of(run_dir)
        assert any("valkey-server" in c for c in started) and any(" coordinator " in c for c in started)
        assert sum(" worker " in c for c in started) == 2
    finally:
        proc.send_signal(signal.SIGINT)  # also on failure: never leave a fleet behind
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out.decode()[-3000:]
    assert processes_of(run_dir) == []
    assert (run_dir / "adamw" / "checkpoint.safetensors").is_file()  # interrupted runs resume from here
