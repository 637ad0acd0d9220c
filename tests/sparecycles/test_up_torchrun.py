"""`sparecycles up --nproc-per-node N` (sparecycles.up_ranks): each run's trainer under torchrun, rank 0 on `up`'s
fleet; checked before any service starts; on CPU two gloo ranks give the losses of `up` in one process.

Tolerance: tests/trainer/test_torchrun.py's TOL (1e-4 nats) and its reason (N=2 sums each rank's half-batch gradient in
the all-reduce where N=1 averages the whole batch: the same data, float32 sums in another order). The fleet does
not make the runs depend on its timing: `up`'s rounds fold at the refresh after them (`--fleet-wait interval`),
waiting for a fleet a whole interval behind, so both runs fold the same rounds at the same steps.

The fleet-probed run compared is zocurv-global (its multiplier moves in discrete upward steps), not `up`'s default
zocurv-line: zocurv-line's first line fit on this tiny model is ill-conditioned, and the last-bit differences of
N=2 flip it (measured: line_ratio_median 0.5 at N=1, 0.92 at N=2, at its first fold), also under plain `train` at
N=2 with in-process probes (losses 2.6e-4 apart after 8 steps), so its N=2 run equals N=1 only up to that fold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sparecycles.up_plan import plan_up
from support.processes import processes_of

TOL = 1e-4  # nats: tests/trainer/test_torchrun.py's (module docstring)
TINY_UP = {"steps": 8, "curvature_interval": 2, "batch_size": 8, "seq_len": 32, "workers": 1, "eval_on": "trainer",
           "optimizer": "zocurv-global"}


def test_ranks_are_checked_before_anything_starts(tmp_path):
    """Two CPU ranks: the plan says gloo and evaluates on the ranks; a batch the ranks cannot split, a probe batch
    larger than a rank's shard and --eval-on fleet are refused with the fix, nothing written."""
    from sparecycles.up_ranks import launch_note

    plan = plan_up(run_dir=tmp_path / "up", steps=8, batch_size=8, seq_len=32, nproc_per_node=2)
    assert plan.nproc == 2 and plan.eval_on == "trainer" and plan.zo_cfg.device == "cpu"
    assert "2 rank(s) under torchrun on the CPU, process group gloo" in launch_note(plan)
    for kw, words in [({"batch_size": 9}, "not a multiple of the 2 ranks"),
                      ({"batch_size": 4}, "--probe-batch-size 4 exceeds the 2 sequences per rank"),
                      ({"batch_size": 8, "eval_on": "fleet"}, "evaluates on its ranks")]:
        with pytest.raises(ValueError, match=words):
            plan_up(run_dir=tmp_path / "up", steps=8, seq_len=32, nproc_per_node=2, **kw)
    assert not (tmp_path / "up").exists()


def test_more_ranks_than_gpus_is_refused_before_any_service(tmp_path):
    """`up --nproc-per-node` one more than the CUDA devices (with CUDA: --gpus auto; without: --device cuda, refused
    for CUDA's absence): exit 2 with the reason, no run folder, so no service was started."""
    import torch

    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() + 1
    args = ["--gpus", "auto"] if cuda else ["--device", "cuda"]
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "up", "--nproc-per-node", str(n), *args,
                          "--run-dir", str(tmp_path / "up"), "--no-progress"], capture_output=True, text=True,
                         timeout=300)
    want = f"--nproc-per-node {n} exceeds the {n - 1} CUDA device(s)" if cuda else "no CUDA device is visible"
    assert res.returncode == 2 and want in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "up").exists()


def _close(a: list, b: list) -> bool:
    return [x[:2] for x in a] == [x[:2] for x in b] and all(abs(x[2] - y[2]) <= TOL for x, y in zip(a, b, strict=True))


def _losses(run_dir: Path) -> list[tuple[int, str, float]]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r["step"], k, r[k]) for r in recs for k in ("loss", "val_loss") if k in r)


def _mults(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mult_global) of a zocurv-global run's refresh records: where the fleet's line fits moved its steps."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["mult_global"]) for r in recs if "mult_global" in r]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_up_with_two_ranks_equals_up_in_process(tmp_path, monkeypatch):
    """`up` (embedded Valkey, coordinator, one CPU worker) with the tiny demo settings, in process and with
    --nproc-per-node 2 (two gloo ranks, rank 0 posting zocurv-global's line rounds to the worker): both runs' losses
    equal within TOL, the fleet's fits moved the multiplier at the same steps to the same values, the worker
    answered, no process left behind."""
    from sparecycles.up import run_up

    monkeypatch.delenv("REDIS_URL", raising=False)  # up's own Valkey
    monkeypatch.setenv("SPARECYCLES_UP_RUN", "")  # run_up sets it for its children; restored afterwards
    lines: list[str] = []
    one = run_up(plan_up(run_dir=tmp_path / "n1", **TINY_UP), progress=False, export=False, log=lines.append)
    two = run_up(plan_up(run_dir=tmp_path / "n2", nproc_per_node=2, **TINY_UP), progress=False, export=False,
                 log=lines.append)
    assert (one["trainer_ranks"], two["trainer_ranks"]) == (1, 2)
    assert two["trainer_launch"] == "torchrun --nproc-per-node 2"
    assert any("process group gloo" in m for m in lines)
    for name in ("adamw", "zocurv-global"):
        a, b = _losses(tmp_path / "n1" / name), _losses(tmp_path / "n2" / name)
        assert len(a) == 8 + 2 and _close(a, b), (name, a, b)
    mults = _mults(tmp_path / "n2" / "zocurv-global")
    assert mults == _mults(tmp_path / "n1" / "zocurv-global") and mults[-1][1] > 1.0, mults
    assert two["fleet"]["results_accepted"] > 0 and two["fleet"]["workers"] == 1
    assert (tmp_path / "n2" / "logs" / "zocurv-global.config.json").is_file()
    assert processes_of(tmp_path / "n2") == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_stops_the_ranks_and_every_service(tmp_path):
    """Ctrl-C to `up --nproc-per-node 2` while its ranks train: torchrun (in a session of its own) gets one SIGTERM,
    the ranks checkpoint and stop, then every service stops; nothing of the run is left running, and the same
    command would resume from the ranks' checkpoint.

    `up` starts with SIGINT ignored, as the full CI run started it where this SIGINT was once lost (up finished
    both runs, rc 0): a command a shell without job control puts in the background inherits SIGINT ignored, and
    Python then installs no handler, so the signal was dropped (tests/sparecycles/test_signals.py shows the same loss at
    `up`'s start-up). `up` now installs its own from its first instruction (trainer.console.stop_signals), and
    launch_torchrun its own while the ranks run."""
    import signal
    import time

    from support.processes import start_up

    run_dir = tmp_path / "up-int"
    proc = start_up(run_dir, "--nproc-per-node", "2", "--steps", "500", "--batch-size", "8", "--seq-len", "32",
                    "--workers", "1", sigint_ignored=True)
    try:
        metrics, deadline = run_dir / "adamw" / "metrics.jsonl", time.monotonic() + 600
        # a step's record: the ranks are in their step loop, where a signal stops them after a step, checkpointed
        while time.monotonic() < deadline and not (metrics.is_file() and '"loss"' in metrics.read_text()):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        ranks = [c for c in processes_of(run_dir) if "train --config" in c and "trainer.torchrun_agent" not in c]
        assert len(ranks) == 2, processes_of(run_dir)
    finally:
        proc.send_signal(signal.SIGINT)  # also on failure: never leave a fleet behind
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out.decode()[-3000:]
    # torchrun's agent (trainer.torchrun_agent) says it stopped in one line: no SignalException traceback
    assert "torchrun: stopped by SIGTERM" in out.decode() and "Traceback" not in out.decode(), out.decode()[-3000:]
    assert processes_of(run_dir) == []
    assert (run_dir / "adamw" / "checkpoint.dcp" / "sparecycles.json").is_file()  # the ranks' collective save
    again = plan_up(run_dir=run_dir, steps=500, batch_size=8, seq_len=32, workers=1, nproc_per_node=2)
    assert again.states["adamw"].kind == "resume"  # the same command continues from there


def test_rank_args_carry_the_teacher_queue_not_the_url(tmp_path):
    """`up --nproc-per-node --teacher`: a rank's train arguments name the run's teacher queue and --kd-strict (as up
    waits unless --fleet-wait never) and never the Redis URL (it travels in $SPARECYCLES_TEACHER_ROUNDS)."""
    from sparecycles.up_ranks import RankRun, rank_args

    plan = plan_up(run_dir=tmp_path / "up", steps=8, batch_size=8, seq_len=32, nproc_per_node=2)
    path, run = tmp_path / "c.json", RankRun(resume=False, progress=False, export=False, metrics_port=0)
    waits, never = replace(plan, fleet_wait="interval"), replace(plan, fleet_wait="never")
    args = rank_args(waits, plan.zo_cfg, config_path=path, run=replace(run, teacher_queue="upab12-adamw"))
    assert args[args.index("--teacher-queue") + 1] == "upab12-adamw" and "--kd-strict" in args
    assert not any("redis" in a for a in args)
    assert "--kd-strict" not in rank_args(never, plan.zo_cfg, config_path=path, run=replace(run, teacher_queue="q"))
    assert "--teacher-queue" not in rank_args(waits, plan.zo_cfg, config_path=path, run=run)
    fleet = rank_args(replace(waits, eval_deadline=5.0), plan.zo_cfg, config_path=path,
                      run=replace(run, coordinator="http://127.0.0.1:1"))
    assert fleet[fleet.index("--fleet-wait") + 1] == "interval" and fleet[fleet.index("--eval-deadline") + 1] == "5.0"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_up_with_two_ranks_distils_from_teacher_rounds(tmp_path, monkeypatch):
    """`up --nproc-per-node 2 --teacher DIR`: the teacher answers on a teacher worker (no teacher in the ranks);
    each run took every step's targets, none missing."""
    from sparecycles.up import run_up
    from trainer.export import export_model, gpt2_tokenizer
    from trainer.models import build_model

    monkeypatch.delenv("REDIS_URL", raising=False)  # up's own Valkey
    monkeypatch.setenv("SPARECYCLES_UP_RUN", "")
    teacher = export_model(build_model("gpt2-tiny", seed=123), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    lines: list[str] = []
    plan = plan_up(run_dir=tmp_path / "up", nproc_per_node=2, settings={"teacher": str(teacher)},
                   **{**TINY_UP, "steps": 4})
    assert plan.teacher_rounds
    summary = run_up(plan, progress=False, export=False, log=lines.append)
    assert any("answers teacher rounds" in m and "by each rank for its rows" in m for m in lines), lines
    for name in ("adamw", "zocurv-global"):
        kd = json.loads((tmp_path / "up" / name / "summary.json").read_text())["kd"]
        assert (kd["kd_taken_steps"], kd["kd_missing_steps"]) == (4, 0), (name, kd)
    assert summary["trainer_ranks"] == 2
    assert processes_of(tmp_path / "up") == []
