"""The first hour, as a new user meets it (issue 30): what `sparecycles train`, `up` and `export` say, through the real
CLI in a subprocess; messages asserted, never times."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from support.paths import ROOT


def _cli(*args: str, env: dict[str, str] | None = None, importtime: bool = False,
         timeout: float = 300, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("SPARECYCLES_COORDINATOR_URL", *unset):
        env.pop(name, None)
    return subprocess.run([sys.executable, *flags, "-m", "sparecycles.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _imported(stderr: str) -> set[str]:
    """Top-level packages a `-X importtime` run imported."""
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("args", "message"), [
    (["train", "--preset", "nope"], "unknown preset 'nope'"),
    (["train", "--lr", "-1"], "error: --lr: Input should be greater than 0"),
    (["train", "--eps", "0"], "error: --eps: Input should be greater than 0"),  # ProbeEps's bound
    (["up", "--lr", "0"], "error: --lr: Input should be greater than 0"),
    (["train", "--seq-len", "300"], "--seq-len 300 exceeds gpt2-tiny's context of 256 tokens"),
    (["train", "--optimizer", "adamw", "--eval-on", "trainer", "--coordinator", "http://127.0.0.1:1"],
     "sends no probes to a fleet"),
    (["train", "--optimizer", "mezo", "--nproc-per-node", "2", "--shard"], "--shard (FSDP2) runs first-order"),
    (["train", "--fleet-wait", "sync"], "--fleet-wait (and --fleet-sync) say when the trainer waits for a fleet's "
     "probe rounds: they need --coordinator"),
    (["up", "--preset", "nope"], "unknown preset 'nope'"),
    (["up", "--optimizer", "adamw"], "AdamW is the baseline"),
])
def test_option_errors_come_before_the_heavy_imports(args, message, tmp_path):
    """An option error exits 2 with its message, having imported neither torch nor transformers."""
    res = _cli(*args, "--run-dir", str(tmp_path / "r"), importtime=True)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-3000:]
    assert not _imported(res.stderr) & {"torch", "transformers"}
    assert not (tmp_path / "r").exists()


def test_export_of_an_up_folder_names_its_runs(tmp_path):
    """`sparecycles export` on the folder `up` wrote (one sub-folder per run) names the runs to export, at once."""
    for run in ("adamw", "zocurv-line"):
        (tmp_path / "up" / run).mkdir(parents=True)
        (tmp_path / "up" / run / "config.json").write_text("{}")
    res = _cli("export", str(tmp_path / "up"), str(tmp_path / "out"), importtime=True)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "holds 2 runs (adamw, zocurv-line; a `sparecycles up` folder)" in res.stderr
    assert f"sparecycles export {tmp_path / 'up' / 'zocurv-line'} OUT_DIR" in res.stderr
    assert not _imported(res.stderr) & {"torch", "transformers"} and not (tmp_path / "out").exists()


def test_train_checks_its_fleet_environment_before_it_starts_anything(tmp_path):
    """`train --coordinator` without SPARECYCLES_REDIS_URL (or with a refused SPARECYCLES_KEY_PREFIX) exits 2 naming
    the variable, with the option checks: no metrics server started, neither torch nor transformers imported."""
    url = f"http://127.0.0.1:{_free_port()}"
    res = _cli("train", "--coordinator", url, "--run-dir", str(tmp_path / "r"), importtime=True,
               env={"SPARECYCLES_ADMIN_TOKEN": "x" * 24}, unset=("SPARECYCLES_REDIS_URL", "REDIS_URL"))
    assert res.returncode == 2 and "a fleet run needs SPARECYCLES_REDIS_URL in the environment" in res.stderr, \
        res.stderr[-3000:]
    assert "trainer metrics at" not in res.stderr and not _imported(res.stderr) & {"torch", "transformers"}
    res = _cli("train", "--coordinator", url, "--run-dir", str(tmp_path / "r"),
               env={"SPARECYCLES_ADMIN_TOKEN": "x" * 24, "SPARECYCLES_REDIS_URL": "redis://127.0.0.1:6379/0",
                    "SPARECYCLES_KEY_PREFIX": "bad prefix"})
    assert res.returncode == 2 and "has an invalid SPARECYCLES_KEY_PREFIX (String should match pattern" in res.stderr
    assert "trainer metrics at" not in res.stderr and not (tmp_path / "r").exists()


def test_coordinator_names_the_variable_it_refuses():
    """`sparecycles coordinator` with a bad SPARECYCLES_KEY_PREFIX (or SPARECYCLES_LEASE_SECONDS) names each one."""
    env = {"SPARECYCLES_ADMIN_TOKEN": "a" * 24, "SPARECYCLES_ENROLLMENT_TOKEN": "e" * 24,
           "SPARECYCLES_KEY_PREFIX": "bad prefix", "SPARECYCLES_LEASE_SECONDS": "-1"}
    res = _cli("coordinator", "--port", str(_free_port()), env=env, timeout=60)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.startswith("refusing to start: SPARECYCLES_KEY_PREFIX: String should match pattern")
    assert "; SPARECYCLES_LEASE_SECONDS: Input should be greater than 0" in res.stderr


def test_metrics_port_0_means_none_for_worker_and_train():
    """`--metrics-port 0` is "no metrics server" for `worker` as for `train`, and both --help texts say so."""
    res = _cli("worker", "--metrics-port", "0", "--coordinator", "http://127.0.0.1:1", "--token", "changeme",
               env={"SPARECYCLES_DEV_MODE": "0"}, timeout=60)
    assert res.returncode == 2 and "--metrics-port" not in res.stderr, res.stderr[-3000:]
    assert "the enrollment token (SPARECYCLES_ENROLLMENT_TOKEN) is the well-known default" in res.stderr
    for cmd in ("worker", "train"):
        text = " ".join(_cli(cmd, "--help", env={"COLUMNS": "200"}, timeout=60).stdout.split())
        assert "0: none" in text, text


def test_unreachable_coordinator_is_reported_at_once():
    """`train --coordinator` to a port nobody listens on says so in its first line, then gives up after --attach-wait."""
    env = {"SPARECYCLES_ADMIN_TOKEN": "x" * 24, "SPARECYCLES_REDIS_URL": "redis://127.0.0.1:6379/0"}
    url = f"http://127.0.0.1:{_free_port()}"
    res = _cli("train", "--optimizer", "1.5spsa", "--coordinator", url, "--attach-wait", "2", env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-3000:]
    first = next(line for line in lines if "not reachable" in line)  # before any wait: the first such line
    assert first.startswith(f"the coordinator at {url} is not reachable or not ready (ConnectError")
    assert "retrying for up to 2 s (--attach-wait)" in first
    assert lines[-1].startswith(f"error: the coordinator at {url} is not reachable or not ready after 2 s")


def test_waiting_for_the_coordinator_counts_down(monkeypatch):
    """While the coordinator stays unreachable, `attach` says so at once and then every COUNTDOWN_EVERY_S seconds."""
    from fleet import attach as attach_mod

    monkeypatch.setattr(attach_mod, "COUNTDOWN_EVERY_S", 0.4)
    said: list[str] = []
    settings = attach_mod.FleetSettings(admin_token="x" * 24, redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(attach_mod.FleetError, match="not reachable or not ready after 2 s"):
        attach_mod.attach(f"http://127.0.0.1:{_free_port()}", settings=settings, wait_s=2.0, log=said.append)
    assert "retrying for up to 2 s" in said[0]
    assert len(said) >= 2 and all(s.startswith("  still not reachable; giving up in ") for s in said[1:])


def test_a_closed_port_fails_after_a_few_refused_tries_not_the_whole_wait(monkeypatch):
    """A port nobody listens on (connection refused) is reported after REFUSED_TRIES tries in a row, not after
    --attach-wait's 120 s: only a coordinator that is starting (not ready, timing out) is worth the long wait."""
    from fleet import attach as attach_mod

    assert attach_mod.REFUSED_TRIES == 10  # ~5 s at 0.5 s apart
    monkeypatch.setattr(attach_mod, "REFUSED_TRIES", 3)
    said: list[str] = []
    url = f"http://127.0.0.1:{_free_port()}"
    settings = attach_mod.FleetSettings(admin_token="x" * 24, redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(attach_mod.FleetError) as exc:
        attach_mod.attach(url, settings=settings, wait_s=3600.0, log=said.append)
    assert str(exc.value) == (f"the coordinator at {url}: connection refused 3 times in a row (nothing listens "
                              "there); check the port in --coordinator and that the coordinator runs")
    assert "retrying for up to 3600 s (--attach-wait)" in said[0]


def test_status_line_is_not_cut_at_80_columns():
    """The live line of `up` (loss, val, workers, probes/s, stale) stays whole on an 80-column terminal."""
    from rich.console import Console

    from trainer.console import status_progress

    status = "loss 10.754 val 10.649 | workers 2 | probes/s 123.4 | stale 0.0%"
    console = Console(record=True, width=80, force_terminal=True)
    bar = status_progress(console=console)
    bar.add_task("zocurv-line gpt2-tiny", total=150, completed=12, status=status)
    console.print(*bar.get_renderables())
    assert status in console.export_text()


def test_log_files_carry_no_progress_bars(tmp_path):
    """A tiny `train` whose stderr is a file: one final line of the step bar, no transformers bars, no `\\r`."""
    res = _cli("train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
               "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "\r" not in res.stderr and "Writing model shards" not in res.stderr, res.stderr[-3000:]
    assert (tmp_path / "r" / "export" / "config.json").is_file()  # the export that drew the bar ran


def test_resumed_up_says_where_it_continues(tmp_path):
    """A run `up` resumes is announced with its checkpoint's step."""
    from sparecycles.up import resume_note
    from support.models import tiny_gpt2
    from trainer.checkpoint import save_checkpoint
    from trainer.config import resolve_preset

    cfg = resolve_preset("demo", {"run_dir": tmp_path / "adamw", "steps": 40})
    cfg.run_dir.mkdir()
    save_checkpoint(cfg.run_dir / "checkpoint.safetensors", model=tiny_gpt2(), optimizer=None, step=7, meta={})
    assert resume_note("adamw", cfg) == f"adamw: resuming the interrupted run at step 7 of 40 ({cfg.run_dir})"
