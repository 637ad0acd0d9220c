"""Teacher targets ahead of time (issue 36): `sparecycles kd fill` with a real teacher worker process on the test
Redis stores exactly the planned steps, each blob the in-process teacher's encoded targets bit for bit; a second
fill sends nothing, a longer one only the rest; `train --kd-cache` equals `train --teacher-rounds --kd-strict`,
counts the steps a cache lacks, and refuses a cache of another plan naming the field."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparecycles.cli import app
from support.teacher import start_teacher_worker, stop_teacher_worker
from trainer.kd.cache import KDPlan, TargetCache, plan_for
from trainer.kd.targets import make_targets
from trainer.kd.teacher import batch_key, load_teacher, teacher_sha256
from wire.kd_targets import encode

STEPS, K = 4, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, redis_url: str):
    """(teacher folder, data folder, redis URL): an exported gpt2-tiny teacher of another seed than the student
    (tokenizer files included, as `train --teacher` needs), real text, and one teacher worker process on the
    queue `train --teacher-rounds` and `kd fill` use by default (kd-<sha[:12]>-<seed 0>)."""
    from support.user_data import real_documents
    from trainer.export import export_model, gpt2_tokenizer
    from trainer.models import build_model

    root = tmp_path_factory.mktemp("kdcache")
    teacher = export_model(build_model("gpt2-tiny", seed=123), root / "teacher", tokenizer=gpt2_tokenizer())
    (root / "data").mkdir()
    (root / "data" / "docs.txt").write_text("\n\n".join(real_documents()))
    queue = f"sparecycles.teacher.kd-{teacher_sha256(str(teacher))[:12]}-0"
    proc = start_teacher_worker(redis_url, queue)
    try:
        yield Path(teacher), root / "data", redis_url
    finally:
        stop_teacher_worker(proc)


def _run_args(teacher: Path, data: Path, steps: int = STEPS, k: int = K) -> list[str]:
    return ["--model", "gpt2-tiny", "--data", str(data), "--teacher", str(teacher), "--steps", str(steps),
            "--batch-size", "2", "--seq-len", "16", "--seed", "0", "--kd-k", str(k), "--kd-estimator", "sampled"]


def _fill(setup, cache: Path, steps: int) -> dict:
    teacher, data, url = setup
    res = CliRunner().invoke(app, ["kd", "fill", *_run_args(teacher, data, steps), "--redis-url", url,
                                   "--cache", str(cache), "--timeout", "60", "--no-progress"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _train(setup, run_dir: Path, *extra: str, k: int = K):
    teacher, data, _ = setup
    return CliRunner().invoke(app, ["train", *_run_args(teacher, data, k=k), "--warmup-steps", "0",
                                    "--eval-batches", "1", "--run-dir", str(run_dir), "--no-progress", "--no-export",
                                    *extra])


def _loss_records(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "loss", "ce_loss", "kd_loss", "val_loss") if k in r} for r in recs]


@pytest.fixture(scope="module")
def filled(setup, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A cache filled in two invocations (2 steps, then all STEPS) and a third that finds everything: their
    reports."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, [_fill(setup, cache, 2), _fill(setup, cache, STEPS), _fill(setup, cache, STEPS)]


def _plan(setup) -> KDPlan:
    from trainer.config import resolve_preset
    from trainer.tasks import build_task

    teacher, data, _ = setup
    cfg = resolve_preset("demo", {"model": "gpt2-tiny", "data": str(data), "teacher": str(teacher), "steps": STEPS,
                                  "batch_size": 2, "seq_len": 16, "seed": 0, "kd_k": K, "kd_estimator": "sampled"})
    return plan_for(cfg, build_task(cfg)), build_task(cfg)


def test_fill_stores_the_planned_steps_bit_for_bit_and_resumes(setup, filled) -> None:
    cache_root, (first, second, third) = filled
    assert (first["planned"], first["present"], first["stored"], first["sent"]) == (2, 0, 2, 2)
    assert (second["present"], second["stored"], second["sent"]) == (2, STEPS - 2, STEPS - 2)  # only the rest
    assert (third["present"], third["stored"], third["sent"]) == (STEPS, 0, 0)  # nothing sent
    assert first["key"] == second["key"] == third["key"]
    plan, task = _plan(setup)
    folder = cache_root / plan.key()
    assert sorted(p.name for p in folder.iterdir()) == [*(f"{s:07d}.kd" for s in range(STEPS)), "plan.json"]
    assert KDPlan.model_validate_json((folder / "plan.json").read_text()).steps == STEPS
    cache = TargetCache(cache_root).open(plan)
    assert cache.missing(range(STEPS + 2)) == [STEPS, STEPS + 1] and cache.get(STEPS) is None
    teacher = load_teacher(str(setup[0]), "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker runs (--threads 1): one summation order, whatever the machine's load
    try:
        with torch.no_grad():
            logits = [teacher(input_ids=task.batch(step)[0]).logits for step in range(STEPS)]
    finally:
        torch.set_num_threads(threads)
    for step in range(STEPS):
        x, z = task.batch(step)[0], logits[step]
        want = encode(make_targets(z, kind="sampled", k=K, temperature=1.0, seed=0, step=batch_key(x), rank=0))
        assert cache.get(step) == want, step  # the in-process teacher's blob, byte for byte (wire.kd_targets.encode)


def test_train_from_the_cache_equals_teacher_rounds_counts_missing_and_refuses_another_plan(
        setup, filled, tmp_path: Path) -> None:
    cache_root, _ = filled
    res = _train(setup, tmp_path / "rounds", "--teacher-rounds", setup[2], "--kd-strict", "--kd-window", "2")
    assert res.exit_code == 0, res.output
    res = _train(setup, tmp_path / "cached", "--kd-cache", str(cache_root))
    assert res.exit_code == 0, res.output
    assert _loss_records(tmp_path / "cached") == _loss_records(tmp_path / "rounds")  # bit for bit: loss, CE, KD, val loss
    assert sum("kd_loss" in r for r in _loss_records(tmp_path / "cached")) == STEPS
    cached = json.loads((tmp_path / "cached" / "summary.json").read_text())
    assert cached["kd"]["kd_taken_steps"] == STEPS and cached["kd"]["kd_missing_steps"] == 0
    rounds = json.loads((tmp_path / "rounds" / "summary.json").read_text())
    assert cached["final_val_loss"] == rounds["final_val_loss"]

    plan, _ = _plan(setup)  # a copy of the key folder, given directly, without step 2: trained on CE, counted
    partial = tmp_path / "partial" / "renamed"
    shutil.copytree(cache_root / plan.key(), partial)
    (partial / "0000002.kd").unlink()
    res = _train(setup, tmp_path / "holes", "--kd-cache", str(partial))
    assert res.exit_code == 0, res.output
    holes = json.loads((tmp_path / "holes" / "summary.json").read_text())
    assert holes["kd"]["kd_missing_steps"] == 1 and holes["kd"]["kd_taken_steps"] == STEPS - 1
    assert holes["warning_counts"]["teacher_missing"] == 1
    assert "kd targets of step 3:" in json.dumps(holes["warnings"])  # 1-based, as metrics.jsonl counts steps
    lines = (tmp_path / "holes" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
    assert [r["step"] for r in recs if "loss" in r and "kd_loss" not in r] == [3]  # the CE-alone step: no kd_loss

    res = _train(setup, tmp_path / "other", "--kd-cache", str(partial), k=8)  # another recipe: refused
    assert res.exit_code == 2 and "k 8 != 4" in res.output and not (tmp_path / "other").exists()
    res = _train(setup, tmp_path / "other", "--kd-cache", str(cache_root), k=8)  # the root: the closest plan named
    assert res.exit_code == 2 and "k 8 != 4" in res.output and not (tmp_path / "other").exists()


def test_micro_batches_and_curvature_probes_take_their_rows_of_the_step_targets(setup, filled, tmp_path: Path) -> None:
    """--micro-batch-size 1 splits each step's 2 rows into 2 forwards; a ZO-Curv refresh probes the first row
    (--probe-batch-size 1). Each is rows of the step's one blob (trainer.kd.sparse_loss.rows_in), so every step
    takes its targets once (none missing) and micro-batching trains the whole batch's KD loss: the run ends where
    the unsplit run does (the same gradient summed in another order: rel 1e-4)."""
    cache_root, _ = filled
    runs = {"whole": (), "micro": ("--micro-batch-size", "1"),
            "zocurv": ("--optimizer", "zocurv-block", "--probes", "2", "--probe-batch-size", "1",
                       "--curvature-interval", "2")}
    summaries = {}
    for name, extra in runs.items():
        res = _train(setup, tmp_path / name, "--kd-cache", str(cache_root), *extra)
        assert res.exit_code == 0, res.output
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
        assert summaries[name]["kd"]["kd_taken_steps"] == STEPS and summaries[name]["kd"]["kd_missing_steps"] == 0
        assert "teacher_missing" not in summaries[name].get("warning_counts", {}), name
        assert sum("kd_loss" in r for r in _loss_records(tmp_path / name)) == STEPS, name
    assert summaries["micro"]["final_val_loss"] == pytest.approx(summaries["whole"]["final_val_loss"], rel=1e-4)
    # each step's record: the whole batch's CE and KD terms, micro-batched or not (before: the last micro-batch's)
    whole, micro = (_loss_records(tmp_path / n) for n in ("whole", "micro"))
    for w, m in zip(whole, micro, strict=True):
        for term in ("ce_loss", "kd_loss"):
            assert (term in w) == (term in m), (w, m)
            assert term not in w or m[term] == pytest.approx(w[term], rel=1e-4), (w, m)


def test_a_rejected_answer_is_asked_again_and_an_unanswered_step_stops_the_fill(setup, tmp_path: Path) -> None:
    """A bad blob under step 0's target key (the worker's SET NX then writes nothing): taken, rejected at intake,
    the step sent again and the worker's answer stored. With no worker on the queue, a step unanswered after
    --attempts sends of --timeout seconds each exits 1, keeping what was stored."""
    import redis

    from wire.kd_targets import KDTargets
    from wire.teacher_messages import recipe_tag, target_key

    teacher, data, url = setup
    plan, task = _plan(setup)
    store = redis.Redis.from_url(url)
    bad = KDTargets(kind="sampled", ids=torch.full((2, 16, K), 50257), logp=torch.full((2, 16, K), -1.0),
                    vocab=50257, temperature=1.0)
    recipe = recipe_tag("sampled", K, 1.0, 0)
    keys = f"kd-bad-{os.getpid()}"  # this fill's answers' keys, named so the bad blob can wait under one
    store.set(target_key(keys, 0, recipe, batch_key(task.batch(0)[0])), encode(bad), ex=600)
    report = _fill_fn(setup, tmp_path / "c1", 1, keys=keys)
    assert (report.stored, report.rejected, report.sent, report.resent) == (1, 1, 2, 1)

    run = f"kd-nobody-{os.getpid()}"
    res = CliRunner().invoke(app, ["kd", "fill", *_run_args(teacher, data, 1), "--redis-url", url, "--cache",
                                   str(tmp_path / "c2"), "--run", run, "--timeout", "0.3", "--attempts", "2",
                                   "--no-progress"])
    assert res.exit_code == 1 and "no valid answer after 2 sends" in res.output, res.output
    assert store.llen(f"sparecycles.teacher.{run}") == 2  # sent twice, never taken
    store.delete(f"sparecycles.teacher.{run}")


def _fill_fn(setup, cache: Path, steps: int, **kw):
    """fleet.kd_fill.fill itself (the command's body) on the settings of _run_args."""
    from fleet.kd_fill import FillOptions, fill
    from trainer.config import resolve_preset

    teacher, data, url = setup
    cfg = resolve_preset("demo", {"model": "gpt2-tiny", "data": str(data), "teacher": str(teacher), "steps": steps,
                                  "batch_size": 2, "seq_len": 16, "seed": 0, "kd_k": K, "kd_estimator": "sampled"})
    return fill(cfg, cache, url, FillOptions(**{"timeout_s": 60.0, **kw}))


def test_two_fills_of_one_plan_never_take_each_others_answers(setup, tmp_path: Path) -> None:
    """Another fill's answer under the queue's run name (what every fill of this plan keyed its answers by before
    issue 47): this fill never takes it; with no worker on its queue it stops unanswered, the blob left for its
    owner. Its own answers come from the worker (the fill of `filled` takes the same queue)."""
    import redis

    from fleet.kd_fill import FillError
    from wire.teacher_messages import recipe_tag, target_key

    teacher, data, url = setup
    plan, task = _plan(setup)
    store = redis.Redis.from_url(url)
    run = f"kd-other-{os.getpid()}"  # a queue no worker consumes
    theirs = target_key(run, 0, recipe_tag("sampled", K, 1.0, 0), batch_key(task.batch(0)[0]))
    blob = encode(make_targets(torch.zeros(2, 16, 50257), kind="sampled", k=K, temperature=1.0, seed=0, step=0,
                               rank=0))
    store.set(theirs, blob, ex=600)
    with pytest.raises(FillError, match="no valid answer after 1 sends"):
        _fill_fn(setup, tmp_path / "c", 1, run=run, attempts=1, timeout_s=0.3)
    assert store.get(theirs) == blob
    store.delete(theirs, f"sparecycles.teacher.{run}")


def test_a_truncated_blob_is_missing_and_asked_again(setup, filled, tmp_path: Path) -> None:
    """A .kd file cut short (a copy that stopped, a full disk) is not present: missing() lists it, has() says no,
    and the next fill asks for it and stores the whole blob again."""
    cache_dir, _ = filled
    copy = tmp_path / "cache"
    shutil.copytree(cache_dir, copy)
    plan, _ = _plan(setup)
    cache = TargetCache(copy).open(plan)
    whole = cache.get(1)
    cache.path(1).write_bytes(whole[: len(whole) - 7])
    assert cache.missing(range(STEPS)) == [1] and not cache.has(1) and cache.has(0)
    report = _fill(setup, copy, STEPS)
    assert (report["present"], report["stored"]) == (STEPS - 1, 1) and cache.get(1) == whole


def test_fill_refuses_a_run_without_teacher(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["kd", "fill", "--model", "gpt2-tiny", "--steps", "2", "--cache",
                                   str(tmp_path / "c"), "--no-progress"])
    assert res.exit_code == 2 and "kd fill needs --teacher" in res.output


def test_a_resumed_run_counts_the_whole_runs_kd_steps(setup, filled, tmp_path: Path, fail_at_step) -> None:
    """A run interrupted at step 3 and resumed (`train --resume`, as `up --resume` trains its runs): summary.json's
    `kd` counts every step of the run, the one missing before the interruption included, and `kd_this_invocation`
    the resumed part's alone (both in `up`'s summary of the run); the step records' counts go on from the
    checkpoint's."""
    from trainer import train as train_mod

    cache_root, _ = filled
    plan, _ = _plan(setup)
    partial = tmp_path / "partial"
    shutil.copytree(cache_root / plan.key(), partial)
    (partial / "0000000.kd").unlink()  # step 1 trains on CE alone, before the interruption
    undo = fail_at_step(train_mod.AdamWMode, 2)
    res = _train(setup, tmp_path / "run", "--kd-cache", str(partial), "--checkpoint-every", "1")
    assert res.exit_code != 0
    undo()
    res = _train(setup, tmp_path / "run", "--kd-cache", str(partial), "--checkpoint-every", "1", "--resume")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2
    assert (summary["kd"]["kd_taken_steps"], summary["kd"]["kd_missing_steps"]) == (STEPS - 1, 1)
    part = summary["kd_this_invocation"]
    assert (part["kd_taken_steps"], part["kd_missing_steps"]) == (STEPS - 2, 0)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kd_taken_steps"] for r in recs if "kd_taken_steps" in r] == [0, 1, 2, 3]
    from sparecycles.up import _run_summary  # what `up --resume` reports of each of its runs: both counts

    assert {k: _run_summary(tmp_path / "run")[k] for k in ("kd", "kd_this_invocation")} == {
        "kd": summary["kd"], "kd_this_invocation": part}
