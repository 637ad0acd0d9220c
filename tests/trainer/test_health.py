"""A run that degrades says so (issue 39): trainer.health's collector on the console, in summary.json's `warnings`
and in the Prometheus counter sparecycles_trainer_warnings_total{run, kind}.

The must-show run: `train --coordinator` (zocurv-line) on a real coordinator with two real worker processes, one
SIGKILLed mid-run: the run prints `workers_lost`, records it in summary.json and counts it in the metric. The
round-derived warnings (dropped, never applied with the share of refreshes that had data, `--require-fleet`) are
checked on the round book's own counters.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import typer
from prometheus_client import REGISTRY

from trainer import health
from trainer.zo.rounds import RoundBook


def _metric(run: str, kind: str) -> float:
    return REGISTRY.get_sample_value("sparecycles_trainer_warnings_total", {"run": run, "kind": kind}) or 0.0


def test_warn_goes_to_the_active_run_once_per_kind_on_the_console(caplog):
    h = health.Health("t-health-a")
    with health.activate(h), caplog.at_level("WARNING", logger="sparecycles.health"):
        health.warn("teacher_missing", "targets of step 3 missing", step=3)
        health.warn("teacher_missing", "targets of step 5 missing", step=5, count=2)
    assert [r.getMessage() for r in caplog.records] == ["targets of step 3 missing"]  # said once
    assert h.counts() == {"teacher_missing": 3} and _metric("t-health-a", "teacher_missing") == 3.0
    assert h.lines() == ["teacher_missing x3: targets of step 3 missing (first at step 3); last: targets of step 5 "
                         "missing"]
    assert health.current() is None
    with pytest.raises(ValueError, match="unknown health warning kind 'nope'"):
        health.warn("nope", "x")


def _round_stats(book: RoundBook) -> list[dict]:
    return [{"step": 1, **book.stats("curv")}]


def test_round_warnings_from_the_round_book_counters():
    from trainer.zo.probes import RoundSpec

    book = RoundBook(staleness=1)
    # Three refreshes of a fleet that never answers: the first round is dropped once stale, none ever folds.
    for v in (0, 2, 4):
        r = RoundSpec(f"r{v}", v, None, 1e-3, (1, 2))
        book._pending[r.round_id], book._arrived[r.round_id] = r, {}
        assert book.due(v) == []
    assert (book.refreshes, book.refreshes_folded, book.folded, book.dropped) == (3, 0, 0, 2)
    h = health.Health("t-health-b")
    h.fleet_probes = True
    h.finish(_round_stats(book))
    assert h.counts() == {"rounds_dropped": 2, "rounds_never_applied": 1}
    assert "0 of 3 refreshes had data" in h.never_applied() and "equals AdamW" in h.never_applied()
    # In process (not fleet-probed) a run without folds is not "never applied"; one that folded is not either.
    h2 = health.Health("t-health-c")
    h2.finish(_round_stats(book))
    assert h2.never_applied() is None


def test_require_fleet_makes_never_applied_an_error(tmp_path, capsys):
    from trainer.cli import _report
    from trainer.train import RunResult

    line = "rounds_never_applied x1: no probe round was ever applied (0 of 3 refreshes had data)"
    (tmp_path / "summary.json").write_text("{}")
    result = RunResult(tmp_path, 6, 5.0, 4.0, 1.0, {"time_ledger": {}, "warnings": [line]})
    _report(result, None)
    err = capsys.readouterr().err
    assert f"warning: {line}" in err and "--require-fleet makes this an error" in err
    with pytest.raises(typer.Exit) as exc:
        _report(result, None, require_fleet=True)
    assert exc.value.exit_code == 1


def _worker_log(path: Path) -> list[tuple[float, str]]:
    """(unix time, message) of each timestamped line of a worker's log ("2026-12-03 08:30:33,211 INFO ...")."""
    import datetime as dt

    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            t = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        out.append((t, line[24:]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_end_cancels_its_rounds_and_workers_go_idle(fleet, tmp_path, monkeypatch):
    """A fleet-probed, fleet-evaluated run ends: its rounds are closed, its queue purged and dropped from the list
    workers consume; no worker starts a task of it later than one control interval after the end (a task already
    evaluating finishes), and the workers stop consuming its queue."""
    import re

    from typer.testing import CliRunner

    from sparecycles.cli import app

    fleet.wait_consuming("a")
    fleet.wait_consuming("b")
    for k in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL", "SPARECYCLES_KEY_PREFIX"):
        monkeypatch.setenv(k, fleet.env[k])
    t_start = time.time()
    res = CliRunner().invoke(app, [
        "train", "--preset", "demo", "--optimizer", "zocurv-line", "--steps", "8", "--curvature-interval", "2",
        "--batch-size", "4", "--seq-len", "32", "--eval-every", "4", "--eval-on", "fleet", "--no-export",
        "--no-progress", "--coordinator", fleet.url, "--metrics-port", "0", "--run-dir", str(tmp_path / "run")])
    t_end = time.time()
    assert res.exit_code == 0, res.output[-3000:]
    control_s = 0.25  # support.fleet's --control-interval
    runs = [r for r in fleet.r.smembers(f"{fleet.prefix}:runs")]
    assert runs == [], runs  # both coordinator runs (probes, evaluation) ended: no queue left to consume
    time.sleep(3.0)  # what a worker would do next, had the run not been cancelled
    for name in ("a", "b"):
        lines = _worker_log(fleet.tmp / f"{name}.log")
        received = {m.group(1): t for t, msg in lines if (m := re.search(r"probe\[([0-9a-f-]+)\] received", msg))}
        done = [(t, m.group(1)) for t, msg in lines if (m := re.search(r"probe\[([0-9a-f-]+)\] succeeded.*'done'", msg))]
        late = [tid for t, tid in done if t > t_end + control_s and received.get(tid, 0) > t_end + control_s]
        assert late == [], (name, late)  # nothing of the ended run started after one control interval
        assert any("stopped consuming" in msg for t, msg in lines if t >= t_start), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_worker_run_warns_on_console_summary_and_metric(fleet, tmp_path, monkeypatch):
    """2 CPU workers, one SIGKILLed at step 2 of a zocurv-line run: `workers_lost` said, recorded and counted."""
    from typer.testing import CliRunner

    from sparecycles.cli import app

    fleet.wait_consuming("a")
    fleet.wait_consuming("b")
    for k in ("SPARECYCLES_ADMIN_TOKEN", "SPARECYCLES_REDIS_URL", "SPARECYCLES_KEY_PREFIX"):
        monkeypatch.setenv(k, fleet.env[k])
    run_dir = tmp_path / "run"
    before = _metric("zocurv-line", "workers_lost")

    def kill_b_at_step_2() -> None:
        path = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if path.exists() and any(json.loads(x).get("step", 0) >= 2 for x in path.read_text().splitlines()
                                     if x.strip().endswith("}")):
                fleet.workers["b"].kill()
                return
            time.sleep(0.05)

    # The trainer's step after the kill scrapes the coordinator only once it counts b lost (its lease expired): the
    # run's speed, whatever the machine, cannot end it before the coordinator noticed.
    from fleet.attach import FleetStatus

    scrape = FleetStatus.snapshot

    def snapshot_after_b_is_lost(self):
        if fleet.workers["b"].poll() is not None:
            fleet.wait(lambda: (fleet.worker_info("b") or {}).get("state") != "active", "b counted lost", 120)
        return scrape(self)

    monkeypatch.setattr(FleetStatus, "snapshot", snapshot_after_b_is_lost)
    killer = threading.Thread(target=kill_b_at_step_2, daemon=True)
    killer.start()
    res = CliRunner().invoke(app, [
        "train", "--preset", "demo", "--optimizer", "zocurv-line", "--steps", "16", "--curvature-interval", "2",
        "--batch-size", "4", "--seq-len", "32", "--eval-every", "8", "--eval-on", "trainer", "--no-export",
        "--no-progress", "--coordinator", fleet.url, "--metrics-port", "0",
        "--run-dir", str(run_dir)])
    killer.join(timeout=5)
    assert res.exit_code == 0, res.output[-3000:]
    assert fleet.workers["b"].poll() is not None  # it was killed mid-run
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    lost = [w for w in summary["warnings"] if w.startswith("workers_lost")]
    assert lost and "fell from 2 to 1" in lost[0], summary["warnings"]
    assert summary["warning_counts"]["workers_lost"] == 1
    assert "warning: workers_lost x1: active probe workers fell from 2 to 1" in res.output
    assert _metric("zocurv-line", "workers_lost") == before + 1


def test_zocurv_optimizer_without_a_probe_source_says_so_once_or_refuses():
    import warnings

    import torch

    from trainer.zo.modes import refresh
    from trainer.zo.optimizers import ZOCurvBlockAdamW

    def stepped(opt, model):
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    model = torch.nn.Linear(3, 2)
    opt = ZOCurvBlockAdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="without a probe source.*steps exactly as AdamW"):
        stepped(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped(opt, model)  # said once, not on every step
    strict = ZOCurvBlockAdamW(model.parameters(), lr=1e-2)
    strict.require_probes = True
    with pytest.raises(RuntimeError, match="ZOCurvBlockAdamW.step\\(\\) without a probe source"):
        stepped(strict, model)
    # Driven by refreshes (as ZOCurvMode and every fleet run do): a probe source, so no warning and no refusal.
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.rounds import RoundBook

    backend = InProcessBackend(model, lambda m, b: m(b).pow(2).mean())
    refresh(strict, RoundBook(staleness=2), backend, torch.ones(2, 3), 0)
    assert strict.probe_source == "refresh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped(strict, model)


def test_bad_environment_refused_naming_the_variable_before_any_port_or_folder(tmp_path):
    """SPARECYCLES_COORDINATOR_URL=not-a-url and SPARECYCLES_CACHE naming a file: exit 2 naming the variable,
    before the metrics server starts (its port stays free) and with no run folder left behind."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SPARECYCLES_ADMIN_TOKEN": "t" * 32, "SPARECYCLES_REDIS_URL": "redis://127.0.0.1:6379/0",
           "SPARECYCLES_COORDINATOR_URL": "not-a-url"}
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "sparecycles.cli", "train", "--preset", "demo", "--optimizer", "zocurv-line",
            "--steps", "2", "--no-progress", "--no-export", "--run-dir", str(run_dir)]
    res = subprocess.run([*args, "--metrics-port", str(port)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "SPARECYCLES_COORDINATOR_URL" in res.stderr and "'not-a-url'" in res.stderr, \
        res.stderr[-2000:]
    assert "trainer metrics at" not in res.stderr and not run_dir.exists()
    (tmp_path / "afile").write_text("x")
    env = {k: v for k, v in env.items() if k != "SPARECYCLES_COORDINATOR_URL"}
    res = subprocess.run(args, env={**env, "SPARECYCLES_CACHE": str(tmp_path / "afile")}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and "SPARECYCLES_CACHE=" in res.stderr and "is a file" in res.stderr, res.stderr[-2000:]
    assert "Errno" not in res.stderr and not run_dir.exists()


def test_errors_name_what_the_user_typed_and_help_lists_the_corpora():
    from typer.testing import CliRunner

    from sparecycles.cli import app
    from sparecycles.up_plan import plan_up

    with pytest.raises(ValueError, match=r"^--set corpus: unknown corpus 'nope'"):
        plan_up(train_options=["corpus=nope"])
    with pytest.raises(ValueError) as exc:
        plan_up(optimizer_options={"s_min": "-1"})
    assert "Value error" not in str(exc.value) and "s_min" in str(exc.value)
    res = CliRunner().invoke(app, ["train", "--optimizer", "zocurv-line", "--optimizer-option", "s_min=-1"])
    assert res.exit_code == 2 and "Value error" not in res.output and "s_min" in res.output
    res = CliRunner().invoke(app, ["train", "--require-fleet", "--steps", "1"], env={"SPARECYCLES_COORDINATOR_URL": ""})
    assert res.exit_code == 2 and "--require-fleet needs --coordinator" in " ".join(res.output.split())
    assert "classics-large" in "".join(CliRunner().invoke(app, ["train", "--help"]).output.split())  # wrapped at "-"


def test_summary_fleet_figures_are_the_last_steps_and_the_peak():
    """summary.json's `fleet` (trainer.report.fleet_summary): the last fleet-probed step's figures, without their
    `fleet_` prefix, and the most workers any step saw; nothing for a run without a fleet."""
    from trainer.report import fleet_summary

    records = [{"step": 1, "loss": 3.0, "fleet_workers": 2.0, "fleet_tasks_redispatched": 0.0},
               {"step": 2, "val_loss": 2.9},  # an evaluation record: no fleet figures
               {"step": 3, "loss": 2.5, "fleet_workers": 1.0, "fleet_tasks_redispatched": 3.0}]
    assert fleet_summary(records) == {"workers": 1.0, "tasks_redispatched": 3.0, "peak_workers": 2.0}
    assert fleet_summary([{"step": 1, "loss": 3.0}]) == {}
