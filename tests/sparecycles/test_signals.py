"""Ctrl-C and SIGTERM from the first instruction of `up` and `train` (trainer.console.stop_signals): real processes
started as a shell without job control starts a background command, with SIGINT *ignored* (the disposition under
which Python installs no KeyboardInterrupt handler, and a signal was lost until the step loop's own handler took
over). Each stop ends with one line: the step checkpointed and the command that resumes, and exit status 128 + the
signal: 130 for Ctrl-C (SIGINT), 143 for SIGTERM (`kill`, Docker/Compose, Kubernetes)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from support.processes import processes_of, read_until, start_cli, start_up


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_during_up_start_up_stops_every_process(tmp_path):
    """SIGINT right after `up`'s Prometheus line (services up, workers starting, no step trained): exit 130 at once,
    one line saying so and the command to rerun, no process of the run left."""
    run_dir = tmp_path / "up"
    proc, seen = start_up(run_dir, "--steps", "500", sigint_ignored=True), []
    try:
        read_until(proc, "Prometheus:", seen)
        assert processes_of(run_dir)  # the services run
    finally:
        proc.send_signal(signal.SIGINT)  # also on failure: never leave a fleet behind
        out = "".join(seen) + proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: every process stopped; adamw: no checkpoint" in out and "resume with: sparecycles up" in out
    assert "Traceback" not in out, out[-3000:]
    assert processes_of(run_dir) == []


def test_ctrl_c_in_train_says_the_step_checkpointed_and_how_to_resume(tmp_path):
    """`train` (SIGINT inherited ignored) stopped by one SIGINT in its step loop: exit 130 after checkpointing, one
    line naming that step (the checkpoint's) and the resume command (this one, --resume added, --overwrite
    dropped); a SIGTERM during its start-up stops it too, saying nothing was trained, with SIGTERM's exit 143."""
    from trainer.checkpoint import checkpoint_step

    run_dir = tmp_path / "run"
    args = ["train", "--preset", "gpt2-tiny", "--corpus", "classics-small", "--optimizer", "adamw", "--steps", "5000",
            "--batch-size", "2", "--seq-len", "16", "--eval-every", "5000", "--eval-batches", "1", "--no-progress",
            "--no-export", "--run-dir", str(run_dir), "--overwrite"]
    proc = start_cli(args, sigint_ignored=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.is_file() and '"loss"' in metrics.read_text()):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, out[-3000:]
    m = re.search(r"stopped after step (\d+), checkpointed in (\S+); resume with: (.+)", out)
    assert m, out[-3000:]
    assert int(m[1]) == checkpoint_step(run_dir / "checkpoint.safetensors") > 0 and m[2] == str(run_dir)
    assert m[3].startswith("sparecycles train --preset gpt2-tiny") and m[3].endswith(f"{run_dir} --resume")
    assert "--overwrite" not in m[3] and "Traceback" not in out

    slow_start = [a if a != "1" else "400" for a in args]  # --eval-batches 400: a long initial evaluation
    proc = start_cli(slow_start, sigint_ignored=True)
    while not (run_dir / "config.json").is_file() or (run_dir / "metrics.jsonl").stat().st_size:  # opened afresh
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # in its start-up: the model built, the step-0 evaluation running
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 143 and "stopped before training began" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize(("signals", "status"), [
    ((signal.SIGINT,), 130), ((signal.SIGTERM,), 143), ((signal.SIGTERM, signal.SIGINT), 143),
    ((signal.SIGINT, signal.SIGTERM), 130)])
@pytest.mark.parametrize("where", ["start-up", "step loop"])
def test_a_clean_stop_exits_128_plus_the_signal_that_asked_for_it(signals, status, where, capsys):
    """trainer.console.stops_cleanly (`train`, `up`, `kd fill`), in process: a stop in start-up (stop_signals: the
    first signal raises) or in the step loop (deferred_interrupt: the first signal is a flag, the loop checkpoints and
    raises Interrupted; a second interrupts at once) exits 128 + the first signal: 143 for SIGTERM, not SIGINT's 130
    (every stop was 130 before), and Ctrl-C stays 130; the stop line is said either way."""
    import typer

    from trainer.console import Interrupted, deferred_interrupt, stops_cleanly

    @stops_cleanly
    def command() -> None:
        if where == "start-up":
            for sig in signals:
                os.kill(os.getpid(), sig)  # the first raises KeyboardInterrupt here
                time.sleep(1)  # never reached: a signal's handler runs before the next instruction
            return
        with deferred_interrupt() as stopped:
            os.kill(os.getpid(), signals[0])
            assert stopped()
            for sig in signals[1:]:
                with pytest.raises(KeyboardInterrupt):  # the second one interrupts at once
                    os.kill(os.getpid(), sig)
                    time.sleep(1)
        raise Interrupted(7, "runs/r")

    with pytest.raises(typer.Exit) as stop:
        command()
    assert stop.value.exit_code == status
    said = capsys.readouterr().err
    assert ("stopped before training began" if where == "start-up" else "stopped after step 7") in said, said
