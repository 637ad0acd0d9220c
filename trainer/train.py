"""The training loop: `train()` runs its phases top to bottom, one function each (after nanoGPT's train.py).

    1. run folder   the Task (LM or sentiment: its data read first, so a refusal there leaves no folder), then
                    RunDir.open: create it, check --resume against its config.json, write config.json
    2. build        the task's model, the method's TrainMode (trainer.methods registry)
    3. position     --resume: Checkpointer.restore (a --steps below its step is refused; another --steps than
                    config.json records re-plans the lr decay: one console line says how, replan_note, and
                    config.json records the new one) and cut metrics.jsonl back to the checkpoint; else start at 0
                    (a checkpoint already at --steps: the loop runs nothing but still ends on the final evaluation)
    4. evaluate     step 0 on the held-out split (kept from the first invocation on resume)
    5. loop         per step: lr schedule -> mode.step -> log -> evaluate every `eval_every` (the Evaluator:
                    on the trainer, or handed to a fleet whose records arrive later and are logged at their own
                    step; all are in before the final checkpoint) -> checkpoint every `checkpoint_every`;
                    Ctrl-C / SIGTERM finish the step, checkpoint, stop (a step waiting for the fleet's round is
                    cut there instead: trainer.console.StopWaiting); an unreachable fleet checkpoints and stops
    6. report       loss.png, summary.json (with the time ledger, trainer.ledger) and (`export`) the model as a
                    transformers folder

Every phase books its wall time in the run's TimeLedger (start-up, step, publish, wait, eval, checkpoint, log,
other); summary.json's `time_ledger` and the console's last lines show it. A fleet evaluation still out when the
run is interrupted or crashes is lost: the resumed run goes on without that record (the final one is always in).

Batches, the learning-rate schedule and all randomness are functions of the step counter, so a resumed
run continues bit-identically on CPU; over a fleet too when its rounds fold at fixed refreshes (the checkpoint
carries the rounds in flight: trainer.zo.modes.ZOCurvMode, trainer.zo.rounds.RoundBook). The step strategies live in trainer.modes (AdamW) and
trainer.zo.modes (ZO-Curv, pure ZO); tasks in trainer.tasks; files in trainer.run_dir / trainer.checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.client import is_transient
from trainer import health as run_health
from trainer import metrics as prom
from trainer.anytime.serve import Anytime
from trainer.checkpoint import Checkpointer  # noqa: F401  (public here too)
from trainer.config import TrainConfig, lr_at, replan_note
from trainer.console import Interrupted, deferred_interrupt, progress_bar, quiet_hf_bars
from trainer.dist_backends import build_rank_mode
from trainer.dist_checkpoint import make_checkpointer
from trainer.distributed import SINGLE, DistContext
from trainer.evaluation import Evaluator, InlineEvaluator, poll_quietly
from trainer.events import EventLog
from trainer.kd.teacher import KDLoss, check_teacher_run, load_teacher
from trainer.ledger import TimeLedger
from trainer.ledger import phase as ledger_phase
from trainer.methods import get_method
from trainer.models import param_order_hash
from trainer.modes import AdamWMode, TrainMode  # noqa: F401  (AdamWMode: tests patch it here)
from trainer.run_dir import CHECKPOINT_NAME, RunDir, default_run_dir  # noqa: F401  (public here too)
from trainer.tasks import LMTask, Task, build_task, evaluate, lm_batch_loss, lm_loss  # noqa: F401  (likewise)
from trainer.train_hooks import TrainHooks
from trainer.train_report import RunResult, write_report


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, overwrite: bool = False,
          export: bool = True, dist: DistContext = SINGLE, hooks: TrainHooks = TrainHooks()) -> RunResult:
    """Run (or resume) a training run and write its run folder (trainer.run_dir: config.json, metrics.jsonl,
    checkpoint.safetensors, loss.png, summary.json, TensorBoard event files mirroring metrics.jsonl
    (trainer.events) and, with `export`, the finished model as a transformers folder `export/` (trainer.export)).

    `cfg.task` picks the Task (`build_task`): evaluation records hold `val_loss` (and `val_acc` for
    sentiment), the summary adds the task's final metrics. `hooks` (trainer.train_hooks.TrainHooks) replace the
    step strategy, the evaluation (its late records are all in before the report) or the distillation targets and
    add a live status line, e.g. a fleet's. `dist`: this rank of a torchrun job (trainer.distributed; rank 0 alone
    writes files and talks to a fleet, checkpoints are DCP folders). summary.json's `time_ledger` splits this
    invocation's wall time into phases (trainer.ledger).

    Raises:
        ValueError: unknown model preset or corpus, CUDA asked for but absent, a folder holding a different
            run's config, `resume` with a `cfg.steps` below the checkpoint's step.
        trainer.checkpoint.CheckpointError: `resume` with no usable checkpoint.
        FileExistsError: the folder already holds a run and neither `resume` nor `overwrite` is set.
        FloatingPointError: the training loss became non-finite.
        KeyboardInterrupt: Ctrl-C or SIGTERM; from the step loop trainer.console.Interrupted (its `step` and
            `run_dir`), after checkpointing the position reached.
        RuntimeError: the fleet stayed unreachable past its retries, after checkpointing the position reached.
    """
    _prepare_device(cfg.device)
    ledger = TimeLedger(sync=torch.cuda.synchronize if cfg.device.startswith("cuda") else None).start()
    with ledger.activate(), run_health.activate(run_health.Health(cfg.optimizer)):
        return _train(cfg, ledger, resume=resume, progress=progress, overwrite=overwrite, export=export, dist=dist,
                      hooks=hooks)


@dataclass
class _Setup:
    """What steps 1-3 built: the run folder, task, model, step strategy, checkpointer, anytime model, the step to
    start at, the metrics kept from an earlier invocation and the evaluator."""

    run: RunDir
    progress: bool
    task: Task
    kind: str
    model: torch.nn.Module
    mode: TrainMode
    ckpt: Any
    anytime: Any
    start: int
    history: list[dict[str, Any]]
    events: EventLog | None
    evaluator: Evaluator
    loss_fn: Any  # the loss of the trainer's steps (with --teacher: KDLoss or trainer.kd.sparse_loss.SparseKDLoss)


class _RunLog:
    """The run's records: each written to metrics.jsonl, TensorBoard and Prometheus alike (by rank 0 only), and
    the evaluation records kept by step (`vals`) for the progress line and the summary."""

    def __init__(self, cfg: TrainConfig, s: _Setup, ledger: TimeLedger) -> None:
        self.cfg, self.s, self.ledger = cfg, s, ledger
        self.vals: dict[int, dict[str, Any]] = {}  # evaluation records by step

    def log(self, record: dict[str, Any]) -> None:
        """One record: metrics.jsonl, TensorBoard and Prometheus alike."""
        if self.s.events is None:  # a rank > 0 of a torchrun job: rank 0 writes
            return
        with self.ledger.phase("log"):
            self.s.run.log(record)
            self.s.events.write(record)
            prom.record(self.cfg.optimizer, record, self.s.task.tokens_per_step)

    def log_vals(self, records: list[dict[str, Any]], done: int, served: dict[str, Any] | None = None) -> None:
        """Evaluation records, possibly late: each logged at its own step (`served`: the anytime model's figures of
        step `done`, the step just evaluated, in its record when that is among them, else a record of their own)."""
        for r in sorted(records, key=lambda r: r["step"]):
            if served and r["step"] == done:
                r, served = {**r, **served}, None
            self.vals[r["step"]] = r
            self.log(r)
        if served:
            self.log({"step": done, **served})


def _train(cfg: TrainConfig, ledger: TimeLedger, *, resume: bool, progress: bool, overwrite: bool, export: bool,
           dist: DistContext, hooks: TrainHooks) -> RunResult:
    """`train` with its time ledger active (the phases booked as the loop reaches them)."""
    with ledger.phase("startup"):  # steps 1-3 (closed before the initial evaluation)
        s = _set_up(cfg, resume=resume, progress=progress, overwrite=overwrite, dist=dist, hooks=hooks)
    book = _RunLog(cfg, s, ledger)
    _initial_evaluation(s, book, ledger, dist)
    wall = _step_loop(cfg, s, book, ledger, dist, hooks.status)
    return write_report(cfg, s, book, ledger, dist, export, wall)


def _set_up(cfg: TrainConfig, *, resume: bool, progress: bool, overwrite: bool, dist: DistContext,
            hooks: TrainHooks) -> _Setup:
    """Steps 1-3: open the run folder, build the task, model and step strategy, and find the position (a resume
    continues from the checkpoint and forgets what was logged after it). Raises as `train` does."""
    if cfg.teacher is not None:  # refused before the run folder exists: task and method, then tokenizers
        check_teacher_run(cfg, fleet=dist.fleet or hooks.mode_factory is not None)

    # 1. the task first: a refusal found while reading the data (an empty file, a bad JSON line) leaves no folder
    progress = progress and dist.is_main
    quiet_hf_bars(progress)
    task = build_task(cfg)
    run = RunDir.open_on_ranks(cfg, resume=resume, overwrite=overwrite, dist=dist,  # then the run folder
                               fleet_probes=hooks.mode_factory is not None)

    # 2. build: model, step strategy
    kind = get_method(cfg.optimizer).kind
    dist.check(cfg, kind)
    model = task.build_model()
    model.train()
    meta = {"config": cfg.run_json(), "param_order_hash": param_order_hash(model)}
    dist.prepare_model(model, kind)  # DDP / FSDP2 in place under torchrun
    # Under torchrun: probes sharded over the ranks, or rank 0's fleet results broadcast to the others.
    loss_fn = _loss_fn(cfg, task, dist, hooks.kd_loss_factory)
    mode = build_rank_mode(cfg, model, loss_fn, hooks.mode_factory, dist)
    ckpt = make_checkpointer(run.path, run.checkpoint, model, mode, meta, dist, resume)

    anytime = _build_anytime(cfg, task, run.path)

    # 3. position: a resume continues from the checkpoint and forgets what was logged after it
    start = ckpt.restore() if resume else 0
    if start > cfg.steps:  # the loop would run nothing and report a run of fewer steps than its weights took
        raise ValueError(f"--steps {cfg.steps} is below the {start} steps the checkpoint in {run.path} has taken; "
                         f"resume with --steps {start} or more, or start afresh with --overwrite")
    if resume and dist.is_main:
        note = replan_note(cfg, planned_steps=run.planned_steps, at_step=start)
        if note is not None:  # another --steps moves the lr decay: said, not done silently
            logging.getLogger(__name__).warning("%s", note)
        run.record_steps(cfg.steps)
    if hasattr(loss_fn, "seek"):  # teacher rounds (trainer.kd.sparse_loss.SparseKDLoss): the window starts at this step
        loss_fn.seek(start)
    history = run.restart_metrics(start if resume else None) if dist.is_main else []
    if resume and hasattr(loss_fn, "carry_counts"):  # teacher targets: the counts go on from the checkpoint's
        loss_fn.carry_counts(next((r for r in reversed(history) if "kd_taken_steps" in r), {}))
    events = EventLog(run.path, resume_step=start if resume else None) if dist.is_main else None
    evaluator_factory = hooks.evaluator_factory
    if evaluator_factory is not None and dist.parallel:  # a sharded forward is collective: every rank evaluates
        logging.getLogger(__name__).warning("a torchrun job evaluates on its ranks, not on the fleet")
        evaluator_factory = None
    evaluator = evaluator_factory(task, cfg, model, mode) if evaluator_factory else InlineEvaluator(task)
    if anytime is not None and hasattr(evaluator, "anytime_scorer"):  # a fleet evaluates: it scores candidates too
        anytime.score_with(evaluator.anytime_scorer(anytime))
    return _Setup(run, progress, task, kind, model, mode, ckpt, anytime, start, history, events, evaluator, loss_fn)


def _initial_evaluation(s: _Setup, book: _RunLog, ledger: TimeLedger, dist: DistContext) -> None:
    """Step 4: the step-0 evaluation on the held-out split, logged once per run (a resume keeps the first
    invocation's record)."""
    kept = dist.broadcast_object(next((r for r in s.history if r["step"] == 0 and "val_loss" in r), None))
    if kept is None:
        with ledger.phase("eval"):
            book.log_vals(s.evaluator.request(0, s.model), s.start)
    else:
        book.vals[0] = kept


def _final_evaluation(s: _Setup, book: _RunLog, ledger: TimeLedger, dist: DistContext, done: int) -> None:
    """The evaluation that ends a run, for a resume whose checkpoint is already at --steps (the loop runs no step):
    the record the interrupted run logged at that step when it has one (kept, as step 0's is), else an evaluation
    of the restored weights, logged as the loop's last step would have (with the anytime model's figures). Without
    it the summary reported step 0's val loss as the final one."""
    kept = dist.broadcast_object(next((r for r in s.history if r["step"] == done and "val_loss" in r), None))
    if kept is not None:
        book.vals[done] = kept
        return
    with ledger.phase("eval"):
        got = s.evaluator.request(done, s.model) + s.evaluator.finish()
        served = s.anytime.evaluate(done, s.model, s.task.evaluate) if s.anytime is not None else None
    book.log_vals(got, done, served)


def _kd_stats(kd) -> dict[str, float]:
    """The step record's distillation figures of loss `kd` (--teacher): this rank's last CE and KD terms (a step on
    CE alone has no KD term: its record has no kd_loss, strict JSON has no NaN) and teacher rounds' counters
    (kd_missing_steps); {} for a plain loss."""
    out = ({name: v for name, v in zip(("ce_loss", "kd_loss"), kd.last, strict=True)
            if not math.isnan(v)} if hasattr(kd, "last") else {})
    out.update(kd.stats() if hasattr(kd, "stats") else {})
    return out


def _evaluate_after(cfg: TrainConfig, s: _Setup, book: _RunLog, ledger: TimeLedger, done: int) -> None:
    """After step `done`: request an evaluation when one is due (every `eval_every` steps and at the end, with the
    anytime model's), else take what the evaluator has finished; the final one is complete before the run reports.
    Logs the records."""
    evaluator, model, anytime = s.evaluator, s.model, s.anytime
    with ledger.phase("eval"):
        due = done % cfg.eval_every == 0 or done == cfg.steps
        got = evaluator.request(done, model) if due else evaluator.poll()
        served = anytime.evaluate(done, model, s.task.evaluate) if due and anytime is not None else None
        if done == cfg.steps:
            got += evaluator.finish()
    book.log_vals(got, done, served)


def _step_loop(cfg: TrainConfig, s: _Setup, book: _RunLog, ledger: TimeLedger, dist: DistContext,
               status: Callable[[], str] | None) -> float:
    """Step 5: the optimizer steps from `s.start` to `cfg.steps` (log, evaluate, checkpoint); returns the loop's
    wall time in seconds. Raises FloatingPointError, KeyboardInterrupt, RuntimeError as `train` does (after
    checkpointing the position reached, where it says so)."""
    task, model, mode, ckpt, anytime, evaluator, kind = s.task, s.model, s.mode, s.ckpt, s.anytime, s.evaluator, s.kind
    done = s.start  # optimizer steps completed
    t0 = time.perf_counter()
    shown = [r for r in s.history if "val_loss" in r][-1:]  # a resume shows its newest evaluation, not step 0's
    with progress_bar(s.progress, f"{cfg.optimizer} {task.model_name}", cfg.steps, s.start, status) as show, \
            deferred_interrupt() as interrupted:
        failed = True
        try:
            if done == cfg.steps:  # a resume with no step left (--steps = the checkpoint's step): the run still ends
                _final_evaluation(s, book, ledger, dist, done)  # on an evaluation of its weights, as it would have
            for step in range(s.start, cfg.steps):
                lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                           schedule=cfg.schedule)
                with ledger.phase("step"):
                    stats = mode.step(step, dist.batch_for(task, step, kind), lr)
                stats = dist.mean_over_ranks(stats) if kind != "pure-zo" else stats
                if not math.isfinite(stats.get("loss", 0.0)):
                    raise FloatingPointError(f"loss became non-finite at step {step}; lower --lr")
                done = step + 1
                if anytime is not None:
                    anytime.publish(done, model)
                book.log({"step": done, "lr": lr, "tokens": done * task.tokens_per_step,
                          "elapsed_s": time.perf_counter() - t0, **stats, **_kd_stats(s.loss_fn)})
                _evaluate_after(cfg, s, book, ledger, done)
                if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                    with ledger.phase("checkpoint"):
                        ckpt.save(done)
                with ledger.phase("log"):
                    last = max([*shown, *book.vals.values()], key=lambda r: r["step"], default={})
                    val = f" val {last['val_loss']:.3f}" if "val_loss" in last else ""  # none before the first
                    show(done, f"loss {stats.get('loss', float('nan')):.3f}{val}")  # evaluation is in (a fleet's)
                if dist.any(interrupted()):  # every rank stops after the same step
                    raise KeyboardInterrupt
            failed = False
        except KeyboardInterrupt as exc:
            with ledger.phase("eval"):  # what the fleet returned so far; Ctrl-C does not wait for the rest
                book.log_vals(poll_quietly(evaluator), done)
            with ledger.phase("checkpoint"):
                ckpt.save(done)  # keep the position reached; `--resume` continues from here
            raise Interrupted(done, s.run.path) from exc
        except Exception as exc:
            # The fleet stayed unreachable past its bounded retries (Redis or coordinator down): the
            # failed step applied nothing, so the position reached is kept for `--resume`.
            if not (isinstance(exc, ConnectionError) or is_transient(exc)):
                raise
            ckpt.save(done)
            raise RuntimeError(f"the fleet stayed unreachable ({exc}); checkpointed at step {done}: "
                               "rerun with --resume") from exc
        finally:
            _close_mode(mode, failed)
            _close_mode(evaluator, failed)
            if callable(getattr(s.loss_fn, "close", None)):  # teacher rounds: the teacher run ends with the run
                s.loss_fn.close()
    return time.perf_counter() - t0


def _loss_fn(cfg: TrainConfig, task: Task, dist: DistContext, kd_loss_factory=None):
    """The task's loss, or with --teacher the distillation loss: kd_loss_factory's (teacher rounds on the
    fleet), else trainer.kd.teacher.KDLoss in process."""
    if cfg.teacher is None:
        return task.loss_fn
    if kd_loss_factory is not None:
        kind = get_method(cfg.optimizer).kind

        def rank_batch(step: int):
            """This rank's batch of `step` as it trains on it (under torchrun its rows of the global batch; (x, y),
            or MicroBatches): the factory's sources make one step's targets for its rows joined, and the loss
            gives each micro-batch its rows of them (trainer.kd.sparse_loss)."""
            return dist.batch_for(task, step, kind)

        return kd_loss_factory(cfg, task, dist.rank, batch_fn=rank_batch)
    return KDLoss(load_teacher(cfg.teacher, cfg.device), alpha=cfg.kd_alpha, estimator=cfg.kd_estimator,
                  k=cfg.kd_k, temperature=cfg.kd_temperature, seed=cfg.seed, rank=dist.rank)


def _build_anytime(cfg: TrainConfig, task: Task, run_path: Path):
    """The run's anytime model (trainer.anytime.serve.Anytime) or None when `cfg.anytime` is off.
    Raises ValueError when the corpus has no selection split."""
    if cfg.anytime is None:
        return None
    corpus = getattr(task, "corpus", None)
    return Anytime(cfg.anytime, getattr(corpus, "select", None), batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   device=cfg.device, run_path=run_path, loss=lm_loss)


def _close_mode(mode: TrainMode, failed: bool) -> None:
    """Close a mode that holds connections (the fleet's: `close(wait)` finishes or, after a failure, cancels its
    background uploads). A finished run raises a last upload's error; a failed one only logs it, so the error
    that ended the run is the one reported."""
    close = getattr(mode, "close", None)
    if not callable(close):
        return
    if not failed:
        with ledger_phase("publish"):  # its last background uploads: the trainer waits for them
            close(wait=True)
        return
    try:
        close(wait=False)
    except Exception as exc:  # noqa: BLE001 - the run's own error is propagating: this one is secondary
        logging.getLogger(__name__).warning("closing the probe backend after a failed run: %s", exc)


def _prepare_device(device: str) -> None:
    """Refuse an absent CUDA device; on CUDA, run fp32 matmuls as TF32 (10-bit mantissa, fp32 accumulate):
    every optimizer of a comparison runs at the same precision, probes included. Raises ValueError."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
