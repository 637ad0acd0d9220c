"""Teacher rounds on the fleet (issue 36): a real Celery teacher worker process on the test Redis answers the
trainer's window; its targets equal the in-process teacher's bit for bit; a killed worker's round is redelivered
and taken once; bad blobs are rejected and counted; missing steps train on CE and are counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from coordinator.celery_app import make_celery
from fleet.teacher import FleetTeacher, RoundFlow, TeacherRecipe, TeacherTimeout, teacher_queue
from support.fleet import Fleet
from support.models import student_teacher_and_data, tiny_llama_dir
from support.teacher import start_teacher_worker, stop_teacher_worker
from trainer.data import get_batch
from trainer.kd.sparse_loss import SparseKDLoss
from trainer.kd.targets import make_targets
from trainer.kd.teacher import batch_key, load_teacher
from trainer.metrics import KD_MISSING, KD_REJECTED
from trainer.models import build_model
from wire.kd_targets import KDTargets, decode, encode
from wire.teacher_messages import TeacherTask, target_key

B, T, K, SEED = 2, 16, 4, 7
TOKENS = np.random.default_rng(0).integers(0, 50257, 4096).astype(np.int64)  # the seeded data of these tests


def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return get_batch(TOKENS, B, T, SEED, step)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gpt2-tiny teacher of another seed than the student's (seed 0): same tokenizer, other weights."""
    path = tmp_path_factory.mktemp("teacher")
    build_model("gpt2-tiny", seed=123).save_pretrained(path)
    return path


def _fleet(redis_url: str, teacher_dir: Path, run: str, k: int = K, steps: int | None = None,
           **flow) -> FleetTeacher:
    """A FleetTeacher of the sampled recipe (k ids) on `run`; `flow`: RoundFlow's fields."""
    return FleetTeacher(make_celery(redis_url), redis.Redis.from_url(redis_url, socket_timeout=10), run=run,
                        teacher=TeacherRecipe(str(teacher_dir), "sampled", k, 1.0, SEED), batch_fn=batch_fn,
                        flow=RoundFlow(**flow), steps=steps)


def _start_worker(redis_url: str, run: str, pause_s: float = 0.0) -> subprocess.Popen:
    return start_teacher_worker(redis_url, teacher_queue(run), pause_s)


def _worker_busy(redis_url: str, run: str) -> bool:
    """Whether the enrolled teacher worker of `run` (support.teacher) heartbeats busy (GET /v1/workers), waiting
    up to 120 s for the heartbeat that says so (a liveness bound only: it beats every 0.5 s)."""
    from support.teacher import coordinator_of

    fleet, deadline = coordinator_of(redis_url), time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(w["name"] == f"teacher-{run}" and w["busy"] for w in fleet.admin.get("/v1/workers").json()):
            return True
        time.sleep(0.2)
    return False


def _reference(teacher_dir: Path, x: torch.Tensor) -> KDTargets:
    """The in-process teacher's targets of batch x through the same wire format (fp16 log-probs), on one CPU
    thread as the test's worker runs: a BLAS that picks its thread count by load (MKL_DYNAMIC) sums in another
    order under another count, and a sampled id at a near-tie can then differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            z = load_teacher(str(teacher_dir), "cpu")(input_ids=x).logits
    finally:
        torch.set_num_threads(threads)
    t = make_targets(z, kind="sampled", k=K, temperature=1.0, seed=SEED, step=batch_key(x), rank=0)
    return decode(encode(t), batch_shape=(B, T), vocab=50257)


def test_fleet_targets_equal_in_process_and_train(redis_url: str, teacher_dir: Path) -> None:
    run = f"kd-{uuid.uuid4().hex[:8]}"
    proc = _start_worker(redis_url, run)
    try:
        fleet = _fleet(redis_url, teacher_dir, run, window=3, strict=True, strict_timeout_s=90)
        loss_fn = SparseKDLoss(fleet, alpha=0.5)
        student = build_model("gpt2-tiny", seed=0)
        for step in range(4):
            x, y = batch_fn(step)
            loss = loss_fn(student, (x, y))
            got, want = loss_fn._cached[1], _reference(teacher_dir, x)
            assert got is not None and torch.equal(got.ids, want.ids) and torch.equal(got.logp, want.logp)
            ce, kd = loss_fn.last
            assert float(loss.detach()) == pytest.approx(0.5 * ce + 0.5 * kd, rel=1e-6) and kd > 0
        assert fleet.missing == 0 and fleet.taken == 4 and fleet.next_step == 3 + 4  # window 3 past step 3
        assert fleet.bytes_up == 7 * len(fleet.task_for(0).ids_b64)  # 7 rounds sent, each its batch's ids
    finally:
        stop_teacher_worker(proc)


def test_missing_and_rejected_counted_and_ce_alone(redis_url: str, teacher_dir: Path) -> None:
    run = f"kd-{uuid.uuid4().hex[:8]}"
    fleet = _fleet(redis_url, teacher_dir, run, window=2)  # no worker: nothing ever arrives
    missing0, rejected0 = KD_MISSING.labels(run)._value.get(), KD_REJECTED.labels(run)._value.get()
    x, y = batch_fn(0)
    loss_fn = SparseKDLoss(fleet, alpha=0.5)
    student = build_model("gpt2-tiny", seed=0)
    loss = loss_fn(student, (x, y))
    assert float(loss.detach()) == loss_fn.last[0] and np.isnan(loss_fn.last[1])  # CE alone
    assert KD_MISSING.labels(run)._value.get() == missing0 + 1
    # an out-of-range id in an answer: rejected at intake, counted, CE alone
    x1 = batch_fn(1)[0]
    bad = KDTargets(kind="sampled", ids=torch.full((B, T, K), 50257), logp=torch.full((B, T, K), -1.0),
                    vocab=50257, temperature=1.0)
    fleet.store.set(target_key(run, 0, fleet.recipe, batch_key(x1)), encode(bad))
    assert fleet.take(x1, 50257) is None
    assert KD_REJECTED.labels(run)._value.get() == rejected0 + 1
    assert KD_MISSING.labels(run)._value.get() == missing0 + 2 and fleet.missing == 2
    fleet.store.delete(f"{teacher_queue(run)}")


def test_strict_waits_only_for_a_round_that_was_sent(redis_url: str, teacher_dir: Path) -> None:
    """--kd-strict on a batch no round was sent for (not a step of the window: the wait could never end): missing
    at once and counted, not a wait of strict_timeout_s (600 s here) ending in TeacherTimeout."""
    run = f"kd-{uuid.uuid4().hex[:8]}"
    fleet = _fleet(redis_url, teacher_dir, run, window=1, strict=True, strict_timeout_s=600)
    assert fleet.take(batch_fn(5)[0], 50257) is None and fleet.missing == 1 and fleet.taken == 0
    fleet.store.delete(teacher_queue(run))


def test_resume_window_starts_at_the_checkpointed_step(redis_url: str, teacher_dir: Path) -> None:
    """seek(start) (trainer.train calls it after the checkpoint's restore): the window sends steps start..
    start + window - 1, the rounds name those steps' batches, and a take advances it by one step."""
    run = f"kd-{uuid.uuid4().hex[:8]}"
    fleet = _fleet(redis_url, teacher_dir, run, window=2)
    loss_fn = SparseKDLoss(fleet, alpha=0.5)
    loss_fn.seek(5)
    assert sorted(fleet.sent.values()) == [5, 6] and fleet.store.llen(teacher_queue(run)) == 2
    assert {batch_key(batch_fn(s)[0]): s for s in (5, 6)} == fleet.sent
    fleet.take(batch_fn(5)[0], 50257)
    assert sorted(fleet.sent.values()) == [6, 7] and fleet.store.llen(teacher_queue(run)) == 3
    fleet.store.delete(teacher_queue(run))


def test_out_of_range_task_ids_rejected() -> None:
    with pytest.raises(ValueError, match="uint32 token ids"):
        TeacherTask(run="r", teacher_dir="/x", teacher_sha256="0" * 64, rank=0, step=0, key=1, batch=2,
                    seq_len=4, ids_b64="AAAAAA==", kind="sampled", k=4, temperature=1.0, seed=0)


# What Celery's worker prints once it has handled the signal sent before the next one (a SIGINT: its warm
# shutdown, and a second SIGINT is the cold one); a signal sent before the last one was handled would merge with it.
HANDLED = {signal.SIGINT: "Hitting Ctrl+C again will initiate cold shutdown"}


def _round_held_by_slow_worker(redis_url: str, teacher_dir: Path, signals: list[int],
                               wait_s: float) -> tuple[str, FleetTeacher]:
    """A strict fleet of window 1 whose step-0 round a slow worker takes and sits on, until `signals` are sent to
    its process group (each once the worker said it handled the one before: HANDLED) and it exits (within
    `wait_s`). Returns (run, fleet)."""
    run = f"kd-{uuid.uuid4().hex[:8]}"
    fleet = _fleet(redis_url, teacher_dir, run, window=1, strict=True, strict_timeout_s=120)
    fleet.advance(0)
    slow = _start_worker(redis_url, run, pause_s=600)
    try:
        # the slow worker (a process started just now: START_TIMEOUT_S) took the round and sits on it
        Fleet.wait(lambda: fleet.store.llen(teacher_queue(run)) == 0, "the slow worker to take the round")
        assert _worker_busy(redis_url, run)  # an enrolled worker, in GET /v1/workers, busy with its round
        for before, sig in zip([None, *signals], signals):
            if before is not None:
                said = HANDLED[before]
                Fleet.wait(lambda said=said: said in slow.log_path.read_text(errors="replace"),
                           f"the worker to handle {signal.Signals(before).name}")
            os.killpg(slow.pid, sig)
        assert slow.wait(wait_s) is not None
    finally:
        stop_teacher_worker(slow)
    return run, fleet


@pytest.mark.slow
def test_killed_worker_round_redelivered_taken_once(redis_url: str, teacher_dir: Path) -> None:
    """A worker SIGKILLed while it holds a round: the broker redelivers it to the next worker; the answer is
    written once (SET NX) and taken once (GETDEL): one take, no missing step, nothing counted twice."""
    run, fleet = _round_held_by_slow_worker(redis_url, teacher_dir, [signal.SIGKILL], wait_s=60)
    proc = _start_worker(redis_url, run)
    try:
        got = fleet.take(batch_fn(0)[0], 50257)
        assert got is not None and fleet.taken == 1 and fleet.missing == 0
        assert fleet.store.get(target_key(run, 0, fleet.recipe, batch_key(batch_fn(0)[0]))) is None  # taken once
    finally:
        stop_teacher_worker(proc)


@pytest.mark.slow
def test_worker_stopped_twice_mid_round_puts_it_back(redis_url: str, teacher_dir: Path) -> None:
    """Ctrl-C twice on a worker holding a round (warm, then cold shutdown: Celery raises into the running round on
    the solo pool): the round is not acked as done or failed; it is back on the queue and the next worker answers."""
    run, fleet = _round_held_by_slow_worker(redis_url, teacher_dir, [signal.SIGINT, signal.SIGINT], wait_s=60)
    assert fleet.store.llen(teacher_queue(run)) == 1  # back on the queue, within seconds (no visibility timeout)
    proc = _start_worker(redis_url, run)
    try:
        got = fleet.take(batch_fn(0)[0], 50257)
        assert got is not None and fleet.taken == 1 and fleet.missing == 0
    finally:
        stop_teacher_worker(proc)


@pytest.mark.slow
def test_train_cli_with_teacher_rounds_end_to_end(redis_url: str, tmp_path: Path) -> None:
    """`sparecycles train --model LLAMA --data TXT --teacher LLAMA2 --teacher-rounds URL --kd-strict` with a
    teacher worker process: every step took its fleet targets (none missing), the ledger has its kd phase and
    summary.json counts the bytes each way."""
    import json

    from typer.testing import CliRunner

    from sparecycles.cli import app
    from trainer.kd.teacher import teacher_sha256

    student, teacher = student_teacher_and_data(tmp_path)
    run = f"kd-{teacher_sha256(str(teacher))[:12]}-0"
    proc = _start_worker(redis_url, run)
    try:
        res = CliRunner().invoke(app, [
            "train", "--model", str(student), "--data", str(tmp_path / "data"), "--teacher", str(teacher),
            "--teacher-rounds", redis_url, "--kd-strict", "--kd-window", "2", "--steps", "3", "--batch-size", "2",
            "--seq-len", "16", "--warmup-steps", "0", "--seed", "0", "--run-dir", str(tmp_path / "run"),
            "--no-progress", "--no-export"])
        assert res.exit_code == 0, res.output
    finally:
        stop_teacher_worker(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kd"]["kd_taken_steps"] == 3 and summary["kd"]["kd_missing_steps"] == 0
    assert summary["kd"]["kd_bytes_up"] == 3 * len(base64_ids(2, 16))  # steps 0..2: none past the run's last
    assert summary["time_ledger"]["counts"]["kd"] == 3 and "teacher_missing" not in summary.get("warning_counts", {})
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "kd_loss" in r]
    assert len(steps) == 3 and all(r["kd_loss"] > 0 and r["kd_missing_steps"] == 0 for r in steps)


def base64_ids(b: int, t: int) -> str:
    """The base64 text of a (b, t) batch's uint32 ids, as a teacher round carries it."""
    import base64

    return base64.b64encode(bytes(4 * b * t)).decode()


def test_worker_rejects_ids_outside_the_teacher_vocabulary_and_counts(redis_url: str, teacher_dir: Path) -> None:
    """A round whose ids exceed the teacher's vocabulary, or whose teacher sha256 is not the folder's: rejected
    (no requeue) / refused, each counted by outcome; nothing is written under its key. A good round: done, and a
    second delivery of it: duplicate (written once)."""
    import base64

    from celery.exceptions import Reject
    from prometheus_client import CollectorRegistry

    from probe_worker.teacher import TeacherMetrics, TeacherRuntime, run_teacher

    run = f"kd-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(redis_url, socket_timeout=10)
    fleet = _fleet(redis_url, teacher_dir, run)
    metrics, runtime = TeacherMetrics(CollectorRegistry()), TeacherRuntime("cpu", store)
    good = fleet.task_for(0).model_dump(mode="json")
    ids = np.full((B, T), 50257, dtype="<u4")
    bad = {**good, "ids_b64": base64.b64encode(ids.tobytes()).decode(), "key": 1}
    with pytest.raises(Reject):
        run_teacher(runtime, metrics, bad)
    assert metrics.tasks.labels("invalid")._value.get() == 1 and not store.exists(target_key(run, 0, fleet.recipe, 1))
    assert run_teacher(runtime, metrics, {**good, "teacher_sha256": "f" * 64, "key": 2}) == "refused"
    assert run_teacher(runtime, metrics, good) == "done"
    assert run_teacher(runtime, metrics, good) == "duplicate"
    assert metrics.tasks.labels("done")._value.get() == 1 and metrics.tasks.labels("duplicate")._value.get() == 1
    assert metrics.tokens_per_s._value.get() > 0
    blob = store.get(target_key(run, 0, fleet.recipe, good["key"]))
    assert metrics.bytes._value.get() == len(blob) > 0  # the one blob written; the duplicate wrote nothing
    store.delete(target_key(run, 0, fleet.recipe, good["key"]))


def test_teacher_rounds_without_teacher_exits_2(tmp_path: Path) -> None:
    """`train --teacher-rounds URL` without --teacher: one line naming the option, exit 2, no run folder."""
    from typer.testing import CliRunner

    from sparecycles.cli import app

    res = CliRunner().invoke(app, ["train", "--preset", "demo", "--steps", "1", "--teacher-rounds",
                                   "redis://127.0.0.1:6379/11", "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert res.exit_code == 2 and "--teacher-rounds needs --teacher" in res.output
    assert not (tmp_path / "run").exists()


def test_kd_strict_or_window_without_teacher_rounds_exits_2(tmp_path: Path) -> None:
    """--kd-strict and --kd-window belong to teacher rounds: without --teacher-rounds they are refused, not ignored."""
    from typer.testing import CliRunner

    from sparecycles.cli import app

    for extra in (["--kd-strict"], ["--kd-window", "4"]):
        res = CliRunner().invoke(app, ["train", "--preset", "gpt2-tiny", "--steps", "2", *extra,
                                       "--run-dir", str(tmp_path / "run"), "--no-progress"])
        assert res.exit_code == 2 and "need --teacher-rounds" in res.output, res.output
        assert not (tmp_path / "run").exists()


def test_teacher_rounds_on_a_redis_that_does_not_answer_exit_2_in_one_line(tmp_path: Path, teacher_dir: Path) -> None:
    """`train --teacher X --teacher-rounds redis://<a closed port>`: `error: --teacher-rounds: the Redis at ... does
    not answer (...)`, exit 2, no traceback."""
    from typer.testing import CliRunner

    from api.server import free_port
    from sparecycles.cli import app
    from trainer.export import export_model, gpt2_tokenizer

    teacher = export_model(build_model("gpt2-tiny", seed=123), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    res = CliRunner().invoke(app, ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--teacher",
                                   str(teacher), "--teacher-rounds", f"redis://127.0.0.1:{free_port()}/0",
                                   "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "error: --teacher-rounds: the Redis at 127.0.0.1:" in res.output and "does not answer" in res.output
    assert "Traceback" not in res.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_teacher_rounds_under_torchrun_teach_each_rank_its_own_rows(redis_url: str, tmp_path: Path) -> None:
    """`train --nproc-per-node 2 --teacher-rounds --kd-strict` (gloo on the CPU): each rank sends the rounds of the
    rows it trains on (its half of the global batch, trainer.distributed.batch_for), so rank 0 takes every step's
    targets and no step trains on CE alone; neither rank leaves a blob unread."""
    import json

    from trainer.export import export_model, gpt2_tokenizer
    from trainer.kd.teacher import teacher_sha256

    teacher = export_model(build_model("gpt2-tiny", seed=123), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    run = f"kd-{teacher_sha256(str(teacher))[:12]}-5"
    store = redis.Redis.from_url(redis_url, socket_timeout=10)
    for key in store.scan_iter(f"sc:kd:{run}-*"):
        store.delete(key)
    proc = _start_worker(redis_url, run)
    try:
        res = subprocess.run([sys.executable, "-m", "sparecycles.cli", "train", "--nproc-per-node", "2",
                              "--teacher", str(teacher), "--teacher-rounds", redis_url, "--kd-strict",
                              "--kd-window", "2", "--steps", "3", "--batch-size", "4", "--seq-len", "16",
                              "--warmup-steps", "0", "--seed", "5", "--run-dir", str(tmp_path / "run"),
                              "--no-progress", "--no-export"], capture_output=True, text=True, timeout=540)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        time.sleep(2)  # a round still being answered would land now
        left = [len(list(store.scan_iter(f"sc:kd:{run}-*:{r}:*"))) for r in (0, 1)]  # keys: run and process id
    finally:
        stop_teacher_worker(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kd"]["kd_taken_steps"] == 3 and summary["kd"]["kd_missing_steps"] == 0, summary["kd"]
    assert "teacher_missing" not in summary.get("warning_counts", {})
    assert left == [0, 0]  # rank 1 took its three steps' targets too (no round is sent past the last step)
    for key in store.scan_iter(f"sc:kd:{run}-*"):
        store.delete(key)


def test_a_blob_of_another_recipe_is_never_taken_and_strict_fails_naming_the_queue(redis_url: str,
                                                                                    teacher_dir: Path) -> None:
    """Two runs of one name and batches but another k: the k=16 run's blob sits under its own recipe, so the k=4
    run finds nothing (it would otherwise train on 16 ids per position as if they were its 4). With --kd-strict
    and no worker, the wait ends in a TeacherTimeout (a ConnectionError: train checkpoints) naming the queue, not
    in CE alone."""
    run = f"kd-{uuid.uuid4().hex[:8]}"
    k16 = _fleet(redis_url, teacher_dir, run, k=16)
    k4 = _fleet(redis_url, teacher_dir, run, strict=True, strict_timeout_s=0.5, steps=1)
    assert k4.recipe != k16.recipe
    x = batch_fn(0)[0]
    k16.store.set(target_key(run, 0, k16.recipe, batch_key(x)), b"k16 blob", ex=60)
    assert k4._get(batch_key(x)) is None
    assert k4.advance(0) == 1  # the run's window: its one step (steps=1), none past it
    with pytest.raises(TeacherTimeout, match=rf"no teacher targets for step 0 in 0 s on queue {teacher_queue(run)}"):
        k4.take(x, 50257)
    assert k4.next_step == 1
    k16.store.delete(target_key(run, 0, k16.recipe, batch_key(x)), teacher_queue(run))  # the blob, the unread round


def test_two_runs_of_one_teacher_and_seed_each_take_their_own(redis_url: str, teacher_dir: Path) -> None:
    """Two trainings of one teacher, seed and recipe on one store at once (a sweep over alpha, as on the H200 where
    one run took the other's answers and the other waited until --kd-strict gave up): one queue and one worker
    serve both, each run's answers sit under its own keys, and both take every step's targets."""
    from fleet.teacher import kd_loss_factory
    from trainer.config import TrainConfig

    name = f"kd-{uuid.uuid4().hex[:8]}"
    build = kd_loss_factory(redis_url, window=2, strict=True, strict_timeout_s=90, run=name)
    cfg = TrainConfig(model="gpt2-tiny", teacher=str(teacher_dir), kd_estimator="sampled", kd_k=K, seed=SEED,
                      steps=3, warmup_steps=0)
    a, b = (build(cfg, None, 0, batch_fn=batch_fn).source for _ in range(2))
    assert a.queue == b.queue == teacher_queue(name) and a.run != b.run and a.recipe == b.recipe
    proc = _start_worker(redis_url, name)
    try:
        for fleet in (a, b):
            fleet.seek(0)
        for step in range(3):
            x = batch_fn(step)[0]
            got_a, got_b = a.take(x, 50257), b.take(x, 50257)
            assert got_a is not None and got_b is not None and torch.equal(got_a.ids, got_b.ids)
        assert (a.taken, a.missing, b.taken, b.missing) == (3, 0, 3, 0)
    finally:
        stop_teacher_worker(proc)


@pytest.mark.slow
def test_a_round_queued_past_its_ttl_is_dropped_not_answered(redis_url: str, teacher_dir: Path) -> None:
    """A round that waited in its queue past round_ttl_s (no worker then) is dropped by the worker that takes it
    (Celery `expires`), unanswered; a fresh round behind it is answered (the worker took them in order, so the
    dropped one was handled first)."""
    run = f"kd-{uuid.uuid4().hex[:8]}"
    fleet = _fleet(redis_url, teacher_dir, run, window=1, steps=2, round_ttl_s=1.0)
    fleet.seek(0)  # step 0's round, expiring in 1 s
    time.sleep(1.5)  # it expires in the queue (not an assertion on timing)
    fleet.round_ttl_s = 600.0
    fleet.advance(1)  # step 1's round, fresh
    keys = [target_key(run, 0, fleet.recipe, fleet.task_for(s).key) for s in (0, 1)]
    proc = _start_worker(redis_url, run)
    try:
        deadline = time.monotonic() + 180  # a liveness bound only
        while not fleet.store.exists(keys[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_teacher_worker(proc)
    assert fleet.store.exists(keys[1]) and not fleet.store.exists(keys[0])
    assert fleet.store.llen(teacher_queue(run)) == 0
    fleet.store.delete(*keys)


@pytest.mark.slow
def test_ctrl_c_during_a_strict_wait_stops_the_run_at_once_saying_so(redis_url: str, tmp_path: Path) -> None:
    """`train --teacher-rounds --kd-strict` with no worker on its queue, Ctrl-C (SIGINT) while the first step waits
    for its targets: the wait ends at once with a line saying so, the step trains on CE alone, the run checkpoints
    and exits 130 (before: silent until the 120 s strict timeout, then TeacherTimeout)."""

    from support.user_data import hf_tokenizer_dir, real_documents

    student = tiny_llama_dir(hf_tokenizer_dir(tmp_path / "student", vocab_size=400), 400, 0)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.txt").write_text("\n\n".join(real_documents()))
    queue = f"kdq-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparecycles.cli", "train", "--model", str(student), "--data", str(tmp_path / "data"),
         "--teacher", str(student), "--teacher-rounds", redis_url, "--teacher-queue", queue, "--kd-strict",
         "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--run-dir", str(tmp_path / "run"),
         "--no-progress", "--no-export"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180  # a liveness bound only
        while store.llen(teacher_queue(queue)) == 0 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(3.0)  # past the window's sending, into the first step's wait (not an assertion on timing)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        store.delete(teacher_queue(queue))
    assert proc.returncode == 130, out
    assert "stopping: not waiting for the teacher's targets of step 1" in out and "stopped after step 1" in out, out
    assert "TeacherTimeout" not in out and "no teacher targets for step" not in out
