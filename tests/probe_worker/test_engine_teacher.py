"""Teacher rounds answered by a serving engine (issue 47, probe_worker.engine_teacher).

Fast: the engine's answers parsed strictly and checked (wrong counts, non-finite or positive log-probabilities,
ids outside the vocabulary, malformed keys are refused), the added prompt id dropped, renormalisation at tau != 1.
Slow (a real vLLM serving SmolLM2-135M in float32, conftest's `vllm_engine`): the engine's top-k equals the
in-process top-k teacher's on real text; a student whose tokenizer is not the engine's is refused, naming both; an
engine that does not answer in time leaves the round unanswered and counted; `train --teacher-rounds` through a
teacher worker process answering from the engine takes every step's targets.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from probe_worker.engine_teacher import (
    EngineAnswerError,
    EngineTeacher,
    position_topk,
    renormalised,
    row_topk,
)
from support.engine_teacher import K, real_rows
from wire.engine_answers import CompletionAnswer


def _answer(row: list[int], k: int, *, first=None, tweak=None) -> CompletionAnswer:
    """An engine answer for one prompt `row`, shaped as vLLM writes it: prompt_logprobs keyed "id" with the
    prompt's own id added (rank k + 1) at every position, and the generated token's top k keyed "token_id:id"."""
    plp: list = [first]
    for t in range(1, len(row)):
        entries = {str(100 + j): {"logprob": -0.1 * (j + 1), "rank": j + 1} for j in range(k)}
        entries[str(row[t])] = {"logprob": -20.0, "rank": 999}
        plp.append(entries)
    top = {f"token_id:{200 + j}": -0.2 * (j + 1) for j in range(k)}
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "prompt_logprobs": plp,
                                         "logprobs": {"tokens": ["token_id:200"], "token_logprobs": [-0.2],
                                                      "top_logprobs": [top], "text_offset": [0]}}]}
    if tweak:
        tweak(body["choices"][0])
    return CompletionAnswer.model_validate_json(json.dumps(body))


def test_an_engine_answer_becomes_topk_rows_with_the_added_prompt_id_dropped() -> None:
    row = [5, 6, 7, 8]
    ids, lps = row_topk(_answer(row, 3).choices[0], row, 3, vocab=1000)
    assert ids.tolist() == [[100, 101, 102]] * 3 + [[200, 201, 202]]
    assert np.allclose(lps[:3], [[-0.1, -0.2, -0.3]] * 3) and np.allclose(lps[3], [-0.2, -0.4, -0.6])
    # unordered entries come back in descending log-probability, ties by id
    assert position_topk({9: -3.0, 4: -1.0, 7: -1.0}, 3, own=1, vocab=10, where="p") == [(4, -1.0), (7, -1.0),
                                                                                           (9, -3.0)]


@pytest.mark.parametrize("tweak, words", [
    (lambda c: c["prompt_logprobs"][1].update({"101": {"logprob": 0.5, "rank": 2}}), "not finite and <= 0"),
    (lambda c: c["prompt_logprobs"][2].update({"102": {"logprob": float("nan"), "rank": 3}}), "not finite"),
    (lambda c: c["prompt_logprobs"][1].update({"99999": {"logprob": -1.0, "rank": 1}}), "entries, expected k"),
    (lambda c: c["prompt_logprobs"][1].pop("100"), "ranked 999, not among the k = 3"),
    (lambda c: c["logprobs"]["top_logprobs"][0].update({"token_id:300": -9.0}), "or k \\+ 1 with id 200 last"),
    (lambda c: c["logprobs"]["top_logprobs"][0].update({"token_id:x": -9.0}), "is not a token id"),
    (lambda c: c["prompt_logprobs"].pop(), "prompt_logprobs must be 4 entries"),
    (lambda c: c.update({"logprobs": None}), "no log-probabilities of the generated token"),
])
def test_an_engine_answer_that_is_not_targets_is_refused_naming_why(tweak, words: str) -> None:
    row = [5, 6, 7, 8]
    with pytest.raises(EngineAnswerError, match=words):
        row_topk(_answer(row, 3, tweak=tweak).choices[0], row, 3, vocab=1000)


def test_ids_outside_the_vocabulary_and_a_first_position_with_entries_are_refused() -> None:
    row = [5, 6, 7, 8]
    with pytest.raises(EngineAnswerError, match="outside the teacher's vocabulary of 150"):
        row_topk(_answer(row, 3).choices[0], row, 3, vocab=150)
    with pytest.raises(EngineAnswerError, match="the first null"):
        row_topk(_answer(row, 3, first={"1": {"logprob": -1.0, "rank": 1}}).choices[0], row, 3, vocab=1000)


def test_renormalised_keeps_the_top_k_distribution_of_the_temperature() -> None:
    """tau = 1: the engine's own values; tau = 2: softmax over the k stored values equals softmax(lp / tau) over
    them (what trainer.kd.estimators.sparse_ce reads), each <= 0."""
    lps = np.log(np.array([[0.5, 0.2, 0.1]]))
    assert np.array_equal(renormalised(lps, 1.0), lps.astype(np.float32))
    out = renormalised(lps, 2.0)
    want = torch.softmax(torch.tensor(lps / 2.0), -1)
    assert torch.allclose(torch.softmax(torch.tensor(out, dtype=torch.float64), -1), want, atol=1e-6)
    assert (out <= 0).all() and math.isclose(float(np.exp(out.astype(np.float64)).sum()), 1.0, rel_tol=1e-6)


# ---- with a real vLLM ----------------------------------------------------------------------------------------


def _task(folder: Path, student: str, x: torch.Tensor, k: int = K, temperature: float = 1.0):
    import base64

    from fleet.teacher import engine_fields
    from trainer.kd.teacher import batch_key, teacher_sha256
    from wire.teacher_messages import TeacherTask

    tok, vocab = engine_fields(student, str(folder))
    return TeacherTask(run=f"eng-{uuid.uuid4().hex[:8]}", teacher_dir=str(folder), teacher_sha256=teacher_sha256(
        str(folder)), rank=0, step=0, key=batch_key(x), batch=int(x.shape[0]), seq_len=int(x.shape[1]),
        ids_b64=base64.b64encode(x.numpy().astype("<u4").tobytes()).decode(), kind="topk", k=k,
        temperature=temperature, seed=0, student_tokenizer=tok, teacher_vocab=vocab)


@pytest.mark.slow
def test_the_engines_topk_equals_the_in_process_topk_teacher(engine_url: str, redis_url: str,
                                                              smollm2_folder: Path) -> None:
    """SmolLM2-135M in float32 on both sides (vLLM's CPU engine; trainer.kd.teacher.load_teacher on the CPU), 2 x 64
    tokens of real text, k = 16. Tolerance: every log-probability within 1e-3 nats of the in-process teacher's
    (rank by rank, and at the engine's own ids of the in-process full log_softmax: both sides sum in other orders,
    measured 8e-5); ids equal rank by rank except where two ids' in-process log-probabilities are within 1e-3 (a
    near-tie the two orders break differently). The round through the worker stores the same targets (fp16
    log-probs on the wire)."""
    from probe_worker.teacher import TeacherMetrics, run_teacher
    from trainer.kd.targets import make_targets
    from trainer.kd.teacher import load_teacher
    from wire.kd_targets import decode, encode
    from wire.teacher_messages import target_key

    x = real_rows(smollm2_folder, 2, 64)
    task = _task(smollm2_folder, str(smollm2_folder), x)
    store = redis.Redis.from_url(redis_url)
    engine = EngineTeacher(engine_url, store)
    got = engine.targets(x.tolist(), K, 1.0, task.teacher_vocab)
    with torch.no_grad():
        z = load_teacher(str(smollm2_folder), "cpu")(input_ids=x).logits.float()
    ref = make_targets(z, kind="topk", k=K, temperature=1.0, seed=0, step=0, rank=0)
    full = torch.log_softmax(z, -1)
    assert got.ids.shape == ref.ids.shape == (2, 64, K) and got.vocab == ref.vocab == 49152
    assert float((got.logp - ref.logp).abs().max()) < 1e-3
    assert float((got.logp - full.gather(-1, got.ids)).abs().max()) < 1e-3
    differ = got.ids != ref.ids
    near = (full.gather(-1, got.ids) - full.gather(-1, ref.ids)).abs() < 1e-3
    assert bool((~differ | near).all()) and float(differ.float().mean()) < 0.01
    metrics = TeacherMetrics(registry=__import__("prometheus_client").CollectorRegistry())
    assert run_teacher(engine, metrics, task.model_dump(mode="json")) == "done"
    blob = store.getdel(target_key(task.run, 0, task.recipe, task.key))
    assert blob == encode(got)
    assert torch.equal(decode(blob, batch_shape=(2, 64), vocab=49152).ids, got.ids)


@pytest.mark.slow
def test_a_student_whose_tokenizer_is_not_the_engines_is_refused_naming_both(engine_url: str, redis_url: str,
                                                                              smollm2_folder: Path) -> None:
    """A gpt2-tiny student (tiktoken GPT-2) and the engine's SmolLM2: the round is refused (counted), its key never
    written, the reason naming the student's tokenizer and the engine's model."""
    from prometheus_client import CollectorRegistry

    from probe_worker.teacher import TeacherMetrics, run_teacher
    from probe_worker.teacher_outcomes import TeacherRefused
    from wire.teacher_messages import target_key

    task = _task(smollm2_folder, "gpt2-tiny", real_rows(smollm2_folder, 1, 8))
    store = redis.Redis.from_url(redis_url)
    engine = EngineTeacher(engine_url, store)
    metrics = TeacherMetrics(registry=CollectorRegistry())
    assert run_teacher(engine, metrics, task.model_dump(mode="json")) == "refused"
    assert metrics.tasks.labels("refused")._value.get() == 1
    assert not store.exists(target_key(task.run, 0, task.recipe, task.key))
    with pytest.raises(TeacherRefused, match=r"engine's tokenizer \(.*smollm2-135m at .*\) differs from the "
                                             r"student's \(gpt2\)"):
        engine.check_tokenizer(task.student_tokenizer)


@pytest.mark.slow
def test_an_engine_that_does_not_answer_in_time_leaves_the_round_unanswered_and_counted(
        engine_url: str, redis_url: str, smollm2_folder: Path) -> None:
    """An engine answer later than the worker's timeout (here 1 ms): outcome engine_error, nothing written (the
    trainer's step then trains on CE alone, counted missing: tests/fleet/test_kd_fleet.py)."""
    import httpx
    from prometheus_client import CollectorRegistry

    from probe_worker.teacher import TeacherMetrics, run_teacher
    from wire.teacher_messages import target_key

    task = _task(smollm2_folder, str(smollm2_folder), real_rows(smollm2_folder, 2, 64))
    store = redis.Redis.from_url(redis_url)
    engine = EngineTeacher(engine_url, store)
    engine.check_tokenizer(task.student_tokenizer)  # the checks answered; the round's request is the late one
    engine.http.timeout = httpx.Timeout(0.001)
    metrics = TeacherMetrics(registry=CollectorRegistry())
    assert run_teacher(engine, metrics, task.model_dump(mode="json")) == "engine_error"
    assert metrics.tasks.labels("engine_error")._value.get() == 1
    assert not store.exists(target_key(task.run, 0, task.recipe, task.key))


@pytest.mark.slow
def test_train_with_teacher_rounds_answered_by_the_engine_takes_every_step(engine_url: str, redis_url: str,
                                                                           smollm2_folder: Path, tmp_path: Path) -> None:
    """`sparecycles train --model STUDENT --teacher SMOLLM2 --teacher-rounds URL --kd-estimator topk --kd-strict` with
    a real enrolled worker (`sparecycles worker --teacher-engine URL`, support.teacher) that never loads the model:
    the student trained through teacher rounds took every step's targets (none missing; the worker answered every
    round through the engine), each step's KD loss finite and positive."""
    from typer.testing import CliRunner

    from sparecycles.cli import app
    from support.teacher import start_teacher_worker, stop_teacher_worker
    from trainer.kd.teacher import teacher_sha256

    student = _student_and_data(tmp_path, smollm2_folder)
    queue = f"sparecycles.teacher.kd-{teacher_sha256(str(smollm2_folder))[:12]}-0"
    proc = start_teacher_worker(redis_url, queue, args=("--teacher-engine", engine_url))
    try:
        res = CliRunner().invoke(app, [
            "train", "--model", str(student), "--data", str(tmp_path / "data"), "--teacher", str(smollm2_folder),
            "--teacher-rounds", redis_url, "--kd-estimator", "topk", "--kd-k", str(K), "--kd-strict",
            "--kd-window", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "0",
            "--seed", "0", "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-export"])
        assert res.exit_code == 0, res.output
    finally:
        stop_teacher_worker(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kd"]["kd_taken_steps"] == 3 and summary["kd"]["kd_missing_steps"] == 0
    assert summary["kd"]["kd_bytes_down"] > 0 and "kd_cache_bytes" not in summary["kd"]  # rounds, not a cache
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "kd_loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0 for r in steps)
    log = proc.log_path.read_text()
    assert f"'{queue}'" in log and "loaded on" not in log  # enrolled, consuming the queue; never loaded the model


def _student_and_data(tmp_path: Path, smollm2_folder: Path) -> Path:
    """A tiny Llama student with SmolLM2's vocabulary and tokenizer files (tmp_path/student) and real text
    (tmp_path/data); returns the student folder."""
    from support.models import tiny_llama_dir
    from support.user_data import real_documents

    student = tmp_path / "student"
    tiny_llama_dir(student, 49152, 0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder / f, student / f)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.txt").write_text("\n\n".join(real_documents()))
    return student


@pytest.mark.slow
def test_kd_fill_from_the_engine_fills_the_target_cache(engine_url: str, redis_url: str, smollm2_folder: Path,
                                                        tmp_path: Path) -> None:
    """`sparecycles kd fill --kd-estimator topk` answered by a worker that asks the engine: every planned step
    stored, each a topk/1 blob of k ids per position that `train --kd-cache` then reads, none missing."""
    from typer.testing import CliRunner

    from fleet.teacher import teacher_queue
    from sparecycles.cli import app
    from support.teacher import start_teacher_worker, stop_teacher_worker

    student = _student_and_data(tmp_path, smollm2_folder)
    run = f"kdfill-{uuid.uuid4().hex[:8]}"
    args = ["--model", str(student), "--data", str(tmp_path / "data"), "--teacher", str(smollm2_folder), "--kd-estimator",
            "topk", "--kd-k", str(K), "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--seed", "0"]
    proc = start_teacher_worker(redis_url, teacher_queue(run), args=("--teacher-engine", engine_url))
    try:
        res = CliRunner().invoke(app, ["kd", "fill", *args, "--redis-url", redis_url, "--cache",
                                       str(tmp_path / "cache"), "--run", run, "--timeout", "120", "--no-progress"])
    finally:
        stop_teacher_worker(proc)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert (report["stored"], report["rejected"], report["unanswered"]) == (2, 0, [])
    res = CliRunner().invoke(app, ["train", *args, "--kd-cache", str(tmp_path / "cache"), "--warmup-steps", "0",
                                   "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-export"])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kd"]["kd_taken_steps"] == 2 and summary["kd"]["kd_missing_steps"] == 0
