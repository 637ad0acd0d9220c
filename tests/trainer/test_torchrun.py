"""The trainer under torchrun (trainer.distributed, trainer.dist_backends, trainer.dist_checkpoint): two CPU ranks on
gloo, launched as real torchrun processes, against the same run in one plain process.

Tolerance for first-order runs: |loss(N=2) − loss(N=1)| <= 1e-4 nats (~1e-5 relative). Not bit-exact because the
arithmetic differs, not the data: the global batch is the same, but N=2 computes each rank's mean loss and
gradient over half of it, sums the two gradients in the all-reduce and halves them, where N=1 averages over the
whole batch at once; float32 addition is not associative, so the gradients differ in their last bits and AdamW
carries that forward. Pure-ZO runs exchange only scalars and replay the same seeds, so they are bit-exact.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from support.torchrun import launch, losses, rank_pid
from trainer.config import resolve_preset
from trainer.distributed import DistContext, MicroBatches

TOL = 1e-4  # nats; see the module docstring
TINY = {"batch_size": 8, "seq_len": 32, "probe_batch_size": 4}


def _args(run_dir: Path, optimizer: str, steps: int, **kw) -> list[str]:
    opts = {**TINY, "optimizer": optimizer, "steps": steps, **kw}
    out = ["--preset", "demo", "--no-export", "--no-progress", "--run-dir", str(run_dir)]
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _in_process(run_dir: Path, optimizer: str, steps: int, resume: bool = False, **kw):
    from trainer.train import train

    cfg = resolve_preset("demo", {**TINY, "optimizer": optimizer, "steps": steps, "run_dir": run_dir, **kw})
    return train(cfg, progress=False, export=False, resume=resume)


def _close(a: list, b: list, tol: float = TOL) -> bool:
    return [x[:2] for x in a] == [x[:2] for x in b] and all(abs(x[2] - y[2]) <= tol for x, y in zip(a, b, strict=True))


class _Task:
    def batch(self, step):
        x = torch.arange(8 * 3).reshape(8, 3) + step
        return x, x + 1


def test_each_rank_reads_its_shard_of_the_same_global_batch():
    task = _Task()
    x, y = DistContext(rank=1, world=2).batch_for(task, 5, "first-order")
    assert torch.equal(x, task.batch(5)[0][4:]) and torch.equal(y, task.batch(5)[1][4:])
    parts = DistContext(rank=1, world=2, micro_batch_size=2).batch_for(task, 5, "first-order")
    assert isinstance(parts, MicroBatches) and [p[0][:, 0].tolist() for p in parts] == [[17, 20], [23, 26]]
    whole = DistContext(rank=1, world=2).batch_for(task, 5, "pure-zo")  # pure ZO shards its probes instead
    assert torch.equal(whole[0], task.batch(5)[0])
    with pytest.raises(ValueError, match="not a multiple of the 3 ranks"):
        DistContext(rank=0, world=3).batch_for(task, 0, "first-order")


def test_refusals_name_the_fix(tmp_path):
    from typer.testing import CliRunner

    from sparecycles.cli import app
    from trainer.distributed import setup

    with pytest.raises(ValueError, match="--shard needs torchrun"):
        setup(device="cpu", shard=True)
    cfg = resolve_preset("demo", {**TINY, "optimizer": "zocurv-line"})
    with pytest.raises(ValueError, match="first-order optimizers only"):
        DistContext(world=2, shard=True).check(cfg, "zo-curv")
    with pytest.raises(ValueError, match="exceeds the 2 sequences per rank"):
        DistContext(world=4).check(cfg, "zo-curv")
    res = CliRunner().invoke(app, ["train", "--device", "cuda", "--nproc-per-node", str(torch.cuda.device_count() + 1),
                                   "--run-dir", str(tmp_path / "r")])
    # Without CUDA the device option is refused first (before torchrun would be launched); with it, the count.
    want = "CUDA device(s) of this machine" if torch.cuda.is_available() else "CUDA is not available on this machine"
    assert res.exit_code == 2 and want in res.output, res.output


def test_micro_batches_accumulate_to_the_whole_batch(tmp_path):
    """One process, the batch in two micro-batches (gradient accumulation) vs whole: the same run within TOL."""
    from trainer.train import train

    cfg = resolve_preset("demo", {**TINY, "optimizer": "adamw", "steps": 2, "eval_every": 2,
                                  "run_dir": tmp_path / "whole"})
    train(cfg, progress=False, export=False)
    train(cfg.model_copy(update={"run_dir": tmp_path / "micro"}), progress=False, export=False,
          dist=DistContext(micro_batch_size=4))
    whole, micro = losses(tmp_path / "whole"), losses(tmp_path / "micro")
    assert _close(whole, micro, 1e-5) and whole != micro  # summed in another order: close, not equal


def _mults(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mult_global) of a zocurv-global run's refresh records: where its line fits moved the step size."""
    import json

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["mult_global"]) for r in recs if "mult_global" in r]


ZO_MICRO = {"curvature_interval": 2, "eval_every": 3}  # zocurv-global: line rounds at steps 2 and 4 fold


def test_zocurv_micro_batches_accumulate_to_the_whole_batch(tmp_path):
    """zocurv-global (probes in process), the batch of 8 in micro-batches of 2 on one process: the run without
    accumulation within TOL (measured: 1.4e-6 nats), the same multipliers (its line fits, on the same probe rows,
    moved mult_global to 1.5 then 2.25: the probes shape the steps compared)."""
    _in_process(tmp_path / "whole", "zocurv-global", 6, **ZO_MICRO)
    from trainer.train import train

    cfg = resolve_preset("demo", {**TINY, "optimizer": "zocurv-global", "steps": 6, **ZO_MICRO,
                                  "run_dir": tmp_path / "micro"})
    train(cfg, progress=False, export=False, dist=DistContext(micro_batch_size=2))
    whole, micro = losses(tmp_path / "whole"), losses(tmp_path / "micro")
    assert _close(whole, micro) and whole != micro  # summed in another order: close, not equal
    assert _mults(tmp_path / "micro") == _mults(tmp_path / "whole") and _mults(tmp_path / "whole")[-1][1] > 1.0


@pytest.mark.timeout(900)
def test_zocurv_two_ranks_with_micro_batches_equal_one_rank(tmp_path):
    """zocurv-global at N=2 under gloo, each rank's shard of 4 in micro-batches of 2 (the global batch still 8),
    probes sharded over the ranks on rank 0's first rows: the one-process run without accumulation within TOL
    (measured: 1.4e-6 nats), the same multipliers."""
    _in_process(tmp_path / "n1", "zocurv-global", 6, **ZO_MICRO)
    proc = launch(2, *_args(tmp_path / "n2", "zocurv-global", 6, **ZO_MICRO), "--micro-batch-size", "2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert _close(losses(tmp_path / "n2"), losses(tmp_path / "n1"))
    assert _mults(tmp_path / "n2") == _mults(tmp_path / "n1")


def test_a_run_resumed_at_another_n_continues_from_its_newest_checkpoint(tmp_path, fail_at_step):
    """Stopped at step 3 in one process (checkpoint.safetensors), resumed by a torchrun job of one rank (launched:
    its DCP folder) and stopped at step 5, resumed in one process again: it continues from step 5, not from the
    older file, and ends as the uninterrupted run; `up` sees the folder as an interrupted run in between."""
    from trainer.modes import AdamWMode
    from trainer.preflight import folder_state
    from trainer.train import train

    kw = {"eval_every": 3, "eval_batches": 2, "checkpoint_every": 2}
    _in_process(tmp_path / "straight", "adamw", 6, **kw)
    cfg = resolve_preset("demo", {**TINY, "optimizer": "adamw", "steps": 6, "run_dir": tmp_path / "mixed", **kw})
    for at, resume, dist in ((3, False, DistContext()), (5, True, DistContext(launched=True))):
        undo = fail_at_step(AdamWMode, at)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, progress=False, export=False, resume=resume, dist=dist)
        undo()
    assert (tmp_path / "mixed" / "checkpoint.safetensors").is_file() and folder_state(cfg.run_dir, cfg).kind == "resume"
    result = train(cfg, progress=False, export=False, resume=True)
    assert result.summary["resumed_from_step"] == 5
    assert losses(tmp_path / "mixed") == losses(tmp_path / "straight")


@pytest.mark.timeout(900)
def test_adamw_two_ranks_equal_one_resume_at_one_and_a_killed_rank_ends_the_run(tmp_path):
    """AdamW at N=2 logs the losses of N=1 (TOL); rank 1 killed after a checkpoint: torchrun stops rank 0 with a
    message, the last DCP checkpoint (saved by 2 ranks) is intact, and a plain process resumes it (N=1,
    resharding) and finishes equal to the uninterrupted N=1 run."""
    steps = 12
    ref = tmp_path / "n1"
    _in_process(ref, "adamw", steps, eval_every=8, checkpoint_every=4)
    run = tmp_path / "n2"
    proc = launch(2, *_args(run, "adamw", steps, eval_every=8, checkpoint_every=4), "--dist-timeout", "60")
    try:
        while not (run / "checkpoint.dcp" / "sparecycles.json").exists():  # the first checkpoint (step 4)
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)  # no hang: rank 0 stops on the broken collective
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "rank 0 stopped" in out and "SIGKILL" in out, out[-3000:]
    before = losses(run)
    assert len(before) >= 5 and _close(before, losses(ref)[: len(before)])  # N=2 equals N=1 up to the kill
    _in_process(run, "adamw", steps, resume=True, eval_every=8, checkpoint_every=4)
    assert _close(losses(run), losses(ref))


# ---- through a real coordinator and worker --------------------------------------------------------------------
REDIS_URL = os.environ.get("SPARECYCLES_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _fleet(tmp_path: Path):
    """A coordinator process (shared Redis, its own key prefix) and one probe worker; yields (url, env)."""
    env = {**os.environ, "SPARECYCLES_REDIS_URL": REDIS_URL, "SPARECYCLES_ADMIN_TOKEN": secrets.token_urlsafe(24),
           "SPARECYCLES_ENROLLMENT_TOKEN": secrets.token_urlsafe(24), "SPARECYCLES_BLOB_DIR": str(tmp_path / "blobs"),
           "SPARECYCLES_KEY_PREFIX": f"tr{secrets.token_hex(4)}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SPARECYCLES_COORDINATOR_URL", None)
    port = _port()
    url = f"http://127.0.0.1:{port}"
    procs = []
    with open(tmp_path / "coordinator.log", "wb") as clog, open(tmp_path / "worker.log", "wb") as wlog:
        try:
            procs.append(subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port),
                                           "--log-level", "warning"], env=env, stdout=clog, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 180  # a liveness bound only: seconds on an idle machine
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                        break
                assert procs[0].poll() is None and time.monotonic() < deadline, (
                    (tmp_path / "coordinator.log").read_text()[-3000:])
                time.sleep(0.2)
            wenv = {k: v for k, v in env.items() if k not in ("SPARECYCLES_REDIS_URL", "SPARECYCLES_ADMIN_TOKEN")}
            procs.append(subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "worker", "--coordinator", url,
                                           "--name", "tr-0", "--threads", "1", "--cache-dir", str(tmp_path / "wcache")],
                                          env=wenv, stdout=wlog, stderr=subprocess.STDOUT))
            yield url, env
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fleet_runs_at_two_ranks_equal_one(tmp_path):
    """zocurv-global (--fleet-sync: each line round folds at its refresh) and 1.5-SPSA probed by a real worker through
    a real coordinator: rank 0 posts the rounds and broadcasts their results; N=2 equals N=1 in process (ZO-Curv
    within TOL, its backprop half being data-parallel; 1.5-SPSA bit for bit)."""
    with _fleet(tmp_path) as (url, env):
        zo = {"curvature_interval": 2, "eval_every": 3}
        proc = launch(2, *_args(tmp_path / "global-n2", "zocurv-global", 6, **zo), "--coordinator", url,
                      "--fleet-sync", env=env)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:] + (tmp_path / "worker.log").read_text()[-2000:]
        proc = launch(2, *_args(tmp_path / "spsa-n2", "1.5spsa", 3, probes=4, eval_every=3), "--coordinator", url,
                      env=env)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:] + (tmp_path / "worker.log").read_text()[-2000:]
    _in_process(tmp_path / "global-n1", "zocurv-global", 6, **zo)
    _in_process(tmp_path / "spsa-n1", "1.5spsa", 3, probes=4, eval_every=3)
    assert _close(losses(tmp_path / "global-n2"), losses(tmp_path / "global-n1"))
    import json

    recs = [json.loads(x) for x in (tmp_path / "global-n2" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("line_accepted", 0) for r in recs) > 0  # the worker's line probes were folded
    assert losses(tmp_path / "spsa-n2") == losses(tmp_path / "spsa-n1")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_micro_batches_equal_one_rank_and_its_checkpoint_loads_in_one_process(tmp_path):
    """--shard (FSDP2) with 2 micro-batches per rank at N=2: the N=1 losses within TOL, a full export gathered on
    rank 0, and its DCP checkpoint (each rank wrote its parameter and AdamW-state shards) loads into a plain
    one-process model and optimizer (resharding): the weights the N=2 run evaluated last."""
    from trainer.dist_checkpoint import DCP_NAME, DistCheckpointer
    from trainer.models import build_model
    from trainer.modes import AdamWMode

    _in_process(tmp_path / "n1", "adamw", 3, eval_every=3)
    proc = launch(2, *[a for a in _args(tmp_path / "n2", "adamw", 3, eval_every=3) if a != "--no-export"],
                  "--shard", "--micro-batch-size", "2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert _close(losses(tmp_path / "n2"), losses(tmp_path / "n1"))
    assert (tmp_path / "n2" / "export" / "model.safetensors").is_file()
    cfg = resolve_preset("demo", {**TINY, "optimizer": "adamw", "steps": 3})
    model = build_model(cfg.model, seed=cfg.seed)
    mode = AdamWMode(model, cfg)
    assert DistCheckpointer(tmp_path / "n2" / DCP_NAME, model, mode, {}, DistContext()).restore() == 3
    assert len(mode.optimizer.state) == len(list(model.parameters()))  # AdamW moments came back too
    # The weights are the N=2 run's own: evaluated here they give its final validation loss.
    from trainer.tasks import LMTask

    final = [v for _, k, v in losses(tmp_path / "n2") if k == "val_loss"][-1]
    assert abs(LMTask(cfg).evaluate(model)["val_loss"] - final) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_zo_runs_interrupted_at_two_ranks_resume_at_one(tmp_path):
    """1.5-SPSA and zocurv-global probing in process at N=2 (each rank evaluates its share of the seeds, the scalars
    all-gathered): SIGTERM to torchrun after a checkpoint stops both ranks after the same step with a collective
    checkpoint; a plain process resumes it and finishes equal to the uninterrupted N=1 run (1.5-SPSA bit for bit,
    zocurv-global within TOL)."""
    import json

    steps = 8
    for opt, kw, exact in (("1.5spsa", {"probes": 4}, True), ("zocurv-global", {"curvature_interval": 2}, False)):
        kw = {**kw, "eval_every": 4, "checkpoint_every": 2}
        ref, run = tmp_path / f"{opt}-n1", tmp_path / f"{opt}-n2"
        _in_process(ref, opt, steps, **kw)
        proc = launch(2, *_args(run, opt, steps, **kw))
        while not (run / "checkpoint.dcp" / "sparecycles.json").exists():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-3000:]
        stopped = json.loads((run / "checkpoint.dcp" / "sparecycles.json").read_text())["step"]
        assert 2 <= stopped < steps, out[-3000:]
        _in_process(run, opt, steps, resume=True, **kw)
        got, want = losses(run), losses(ref)
        assert got == want if exact else _close(got, want), (got, want)


@pytest.mark.parametrize(("body", "code", "said"), [
    ("print('done', end='')", 0, "done"),
    ("raise SystemExit(3)", 3, ""),
    ("raise SystemExit('bad rank')", 1, "bad rank"),
    ("raise KeyboardInterrupt", 130, ""),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_a_rank_ends_with_its_status_and_its_output_without_finalizing(body, code, said):
    """trainer.launch.run_rank: the entry's exit status (typer.Exit's code, 130 for Ctrl-C, 1 and the traceback
    for an error), its unflushed output written, and no interpreter finalization (an atexit handler never runs:
    the finalization that raced gloo's threads is skipped)."""
    script = ("import atexit, sys\nfrom trainer.launch import run_rank\n"
              "atexit.register(lambda: sys.stderr.write('FINALIZED'))\n"
              f"def entry():\n    {body}\nrun_rank(entry)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == code, res.stderr
    assert said in res.stdout + res.stderr and "FINALIZED" not in res.stderr
