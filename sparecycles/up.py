"""`sparecycles up`: the whole system on one machine, no services installed.

Starts an embedded Valkey (unless REDIS_URL is set), the coordinator with fresh random secrets, N local
probe workers (one process each) and the trainer; runs the AdamW baseline and the fleet-probed run at equal
steps on real data (LM pretraining with ZO-Curv on the corpus, or `--task sentiment`: MiniLM-L6 fine-tuning
with pure ZO); writes a run folder with both runs' curves (PNG: losses; for sentiment also accuracy), a JSON
summary and the URLs it served. Every child runs in its own process group and dies with `up` (SIGTERM, then
SIGKILL; on Linux also PR_SET_PDEATHSIG if `up` itself is killed: sparecycles.services). With `--nproc-per-node N`
each run trains under torchrun with N ranks, rank 0 on this fleet (sparecycles.up_ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.attach import Fleet, FleetFiguresMode, FleetSettings, FleetStatus, wait_for_workers  # noqa: F401 (re-exported)
from sparecycles.local_fleet import LocalFleet, local_fleet
from sparecycles.scrape import SCRAPE_CONFIG, write_scrape_config
from sparecycles.services import Supervisor, die_with_parent, free_port
from sparecycles.up_options import SERVING_JSON
from sparecycles.up_plan import UP_SETTINGS, UpPlan, clear_folder, plan_up, read_json  # noqa: F401 (plan_up re-exported)
from sparecycles.up_summary import UpOutcome, build_summary, end_lines, title, write_summary  # noqa: F401 (end_lines re-exported)
from sparecycles.up_summary import run_summary as _run_summary  # noqa: F401 (re-exported: tests/fleet/test_kd_cache.py)
from trainer.run_options import TEACHER_ROUNDS_ENV  # train's --teacher-rounds, for up's torchrun ranks

if TYPE_CHECKING:
    from sparecycles.up_serving import ServingRun


def _prefetch_inputs(cfg, progress: bool) -> None:
    """Fetch (or verify the cache of) the task's data and weights once, before any child races to do it."""
    from trainer.console import quiet_hf_bars

    quiet_hf_bars(progress)
    if cfg.task == "sentiment":
        from trainer.data import load_sentiment
        from trainer.models.pretrained import minilm_dir

        load_sentiment()
        minilm_dir()
    elif cfg.data is not None:
        from trainer.data.user import load_user_corpus

        load_user_corpus(cfg.data, cfg.model, text_field=cfg.text_field, encoding_errors=cfg.encoding_errors,
                         progress=progress)
    else:
        from trainer.data import load_corpus

        load_corpus(cfg.corpus, progress=progress)


UP_ROUNDS = "next"  # fleet.attach.ROUND_MODES: how `up`'s ZO-Curv rounds fold by default (--fleet-wait interval)
FLEET_ROUNDS = {"never": "async", "interval": UP_ROUNDS, "sync": "sync"}  # --fleet-wait -> round mode
ROUNDS_NOTE = ("each curvature round folds at the refresh after it (the trainer waits only if the fleet is a whole "
               "interval behind): the run does not depend on the fleet's timing, and one interrupted and resumed "
               "equals the uninterrupted run bit for bit")
FLEET_PARTS = "fleet_parts.json"  # in the fleet-probed run's folder: one fleet snapshot per part trained


def _read_parts(path: Path) -> list[dict]:
    try:
        parts = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return parts if isinstance(parts, list) else []


def sum_fleet(parts: list[dict]) -> dict:
    """Fleet figures of a run trained in parts (interrupted, resumed): each part's coordinator counters
    (`tasks_published`, `results_<outcome>`) summed, `workers` the most active in any part, `probes_per_s` =
    accepted results / seconds over all parts and `stale_fraction` = stale / all results. One part: itself."""
    if len(parts) == 1:
        return parts[0]
    keys = {k for p in parts for k in p if k == "tasks_published" or k.startswith("results_")}
    out = {k: sum(p.get(k, 0.0) for p in parts) for k in sorted(keys)}
    out["workers"] = max((p.get("workers", 0.0) for p in parts), default=0.0)
    out["seconds"] = sum(p.get("seconds", 0.0) for p in parts)
    out["probes_per_s"] = sum(p.get("probes_per_s", 0.0) * p.get("seconds", 0.0) for p in parts) / max(1e-9, out["seconds"])
    total = sum(v for k, v in out.items() if k.startswith("results_"))
    out["stale_fraction"] = out.get("results_stale", 0.0) / total if total else 0.0
    out["parts"] = len(parts)
    return out


def _rounds_note(optimizer: str, fleet_wait: str = "interval") -> str:
    """How the fleet's probes enter `optimizer`'s steps under `--fleet-wait`, for the console and summary.json."""
    from trainer.methods import get_method

    if get_method(optimizer).kind == "zo-curv":
        if fleet_wait == "never":
            return ("--fleet-wait never: the trainer never waits for a round; each folds at the first refresh after it "
                    "completed, and a round that goes stale first is skipped and counted (curv_dropped_rounds): the "
                    "run depends on the fleet's timing")
        if fleet_wait == "sync":
            return ("--fleet-wait sync: each round folds at its own refresh, the trainer waiting for it: the run "
                    "equals the in-process one")
        return ROUNDS_NOTE
    return "every step waits for all its probes: the run does not depend on the fleet's timing"


def _train_runs(plan: UpPlan, run: Callable[[str, object, bool], None], status, log: Callable[[str], None]) -> dict:
    """Train `up`'s runs not finished with `run(name, cfg, resume)`: AdamW, then the fleet-probed run (interrupted
    ones resume from their checkpoints, which hold the ZO state). Returns the fleet's figures over every part the
    fleet-probed run was trained in ({} when it was finished already)."""
    base_state, zo_state = plan.states["adamw"].kind, plan.states[plan.optimizer].kind
    for name, cfg, state in (("adamw", plan.base_cfg, base_state), (plan.optimizer, plan.zo_cfg, zo_state)):
        if state == "resume":
            log(resume_note(name, cfg))
    if base_state != "done":
        run("adamw", plan.base_cfg, base_state == "resume")
    if zo_state == "done":
        return {}
    # A resumed run's fleet figures add up every part: each interruption records the one it ends.
    parts_path = plan.out / plan.optimizer / FLEET_PARTS
    parts = _read_parts(parts_path) if zo_state == "resume" else []
    log(f"{plan.optimizer}: {_rounds_note(plan.optimizer, plan.fleet_wait)}")
    try:
        run(plan.optimizer, plan.zo_cfg, zo_state == "resume")
    finally:  # the coordinator still answers here: its counters cover this part; its workers, the most seen at once
        parts.append({**status.snapshot(), "workers": status.most_workers})  # (one may be between states at the end)
        parts_path.parent.mkdir(parents=True, exist_ok=True)
        parts_path.write_text(json.dumps(parts, indent=2))
    return sum_fleet(parts)


def _open_fleet(plan: UpPlan, local: LocalFleet, check: Callable[[], None], log: Callable[[str], None],
                teacher_runs: dict[str, str]) -> Fleet:
    """The trainer's handle on `local`'s fleet once its `plan.workers` workers registered (waiting up to 120 s;
    `check` raises when a child died); with teacher rounds, `teacher_runs` (run name -> teacher run) registered."""
    settings, base = local.settings, local.url
    admin = settings.admin_token.get_secret_value()
    # Each ZO-Curv round folds at the refresh after it, whatever the fleet's timing (trainer.zo.rounds.RoundBook
    # lag 1): the run is reproducible and an interrupted one, resumed, is the same run bit for bit.
    # One host: the trainer writes weight shards straight into the coordinator's blob directory and the
    # workers read them there (SPARECYCLES_BLOB_DIR in their environment), no HTTP copies.
    fleet = Fleet(base, FleetSettings(admin_token=admin, redis_url=local.redis_url, key_prefix=settings.key_prefix,
                                      blob_dir=plan.out / "blobs"),
                  plan.workers, FleetStatus(base), run_prefix="up", rounds=FLEET_ROUNDS[plan.fleet_wait])
    wait_for_workers(base, admin, plan.workers, 120.0, check=check)
    if plan.teacher_rounds:
        _register_teacher_runs(base, admin, plan.zo_cfg.teacher, list(teacher_runs.values()))
        log(f"teacher rounds on the {plan.workers} workers: {teacher_note(plan)}")
    return fleet


def _train_with_fleet(plan: UpPlan, progress: bool, log: Callable[[str], None],
                      export: bool, serving: ServingRun | None = None) -> tuple[dict, str]:
    """Start Valkey (unless REDIS_URL), the coordinator and the workers; train the runs not finished (AdamW, then
    the fleet-probed run: in this process, or with `plan.nproc` under torchrun, sparecycles.up_ranks; `export`:
    each also as a transformers folder, trainer.export); stop every child. `serving`: the sparecycles.up_serving.
    ServingRun beside them (its worker options go to every worker, its load starts once they are ready, their
    figures are read before they stop).
    Returns (fleet figures, Redis description)."""
    # Every descendant (Valkey, coordinator, workers, torchrun's ranks) inherits this marker: orphans are findable.
    os.environ["SPARECYCLES_UP_RUN"] = str(plan.out)
    sup = Supervisor(plan.out / "logs")
    try:
        devices = plan.worker_devices or ("cpu",) * plan.workers
        with local_fleet(plan.out, devices, sup, log, worker_args=serving.worker_args if serving else ()) as local:
            redis_url, redis_desc, env, base = local.redis_url, local.redis_desc, local.env, local.url
            admin = local.settings.admin_token.get_secret_value()
            teacher_runs = {name: f"{local.settings.key_prefix}-{name}" for name in ("adamw", plan.optimizer)}
            trainer_port = _serve_metrics(plan.out, local.port, list(local.metrics_ports), log, here=plan.nproc is None)
            fleet = _open_fleet(plan, local, sup.check, log, teacher_runs)
            status = fleet.status

            def run(name: str, cfg, resume: bool) -> None:
                if serving is not None and name != "adamw":  # the requests meet the workers' probe tasks
                    serving.start_load(base, admin, plan.workers)
                if plan.nproc is not None:  # rank 0 attaches to this coordinator as `train --coordinator` does
                    from sparecycles.up_ranks import RankRun, train_ranks

                    ranks_env = {k: v for k, v in env.items()
                                 if k not in ("SPARECYCLES_ENROLLMENT_TOKEN", "SPARECYCLES_COORDINATOR_URL")}
                    if plan.teacher_rounds:  # the ranks' --teacher-rounds URL (trainer.cli), never in their argv
                        ranks_env[TEACHER_ROUNDS_ENV] = redis_url
                    status.snapshot()  # the run's probes/s count from here
                    ranks = RankRun(resume=resume, progress=progress, export=export, metrics_port=trainer_port,
                                    coordinator=base, teacher_queue=teacher_runs[name] if plan.teacher_rounds else None)
                    train_ranks(plan, name, cfg, run=ranks, env=ranks_env, preexec_fn=die_with_parent)
                    return
                from trainer.distributed import DistContext
                from trainer.train import TrainHooks, train

                evaluator = (fleet.evaluator_factory(deadline_s=plan.eval_deadline, full=plan.eval_windows == "full")
                             if plan.eval_on == "fleet" else None)
                probes = {"mode_factory": fleet.mode_factory, "status": status} if name != "adamw" else {}
                if plan.teacher_rounds:  # both runs distil from the teacher the workers serve (teacher rounds)
                    from fleet.teacher import kd_loss_factory

                    probes["kd_loss_factory"] = kd_loss_factory(redis_url, strict=plan.fleet_wait != "never",
                                                                run=teacher_runs[name],
                                                                end=lambda run: _end_teacher_run(base, admin, run))
                dist = DistContext(fleet=name != "adamw", fleet_rounds=FLEET_ROUNDS[plan.fleet_wait])  # config.json
                train(cfg, progress=progress, resume=resume, overwrite=True, export=export,
                      dist=dist, hooks=TrainHooks(evaluator_factory=evaluator, **probes))

            try:
                return _train_runs(plan, run, status, log), redis_desc
            finally:  # the workers still heartbeat here
                if serving is not None:
                    serving.read_workers(base, admin)
    finally:
        sup.stop_all()
        (plan.out / SCRAPE_CONFIG).unlink(missing_ok=True)  # its ports are closed now


def teacher_note(plan: UpPlan) -> str:
    """How `up`'s runs get their teacher's targets, for the console and summary.json."""
    cfg = plan.zo_cfg
    if cfg.teacher is None:
        return "no teacher"
    if not plan.teacher_rounds:
        return f"{cfg.teacher} in the trainer's process (--kd-estimator full: no teacher rounds on the fleet)"
    wait = ("a step whose targets are late trains on CE alone (counted)" if plan.fleet_wait == "never" else
            "the trainer waits for each step's targets (up to 120 s), so the run does not depend on the fleet's timing")
    return (f"{cfg.teacher} answers teacher rounds ({cfg.kd_estimator}, {cfg.kd_k} ids per position, sent 8 steps "
            f"ahead{', by each rank for its rows' if plan.nproc else ''}) for both runs; {wait}")


def _register_teacher_runs(base: str, admin: str, teacher: str, runs: list[str]) -> None:
    """Register `runs`' teacher rounds at the coordinator (fleet.teacher_weights.publish_teacher: the teacher's files
    as blobs, once): the enrolled workers consume their queues and fetch the teacher from there."""
    from coordinator.client import CoordinatorClient
    from fleet.teacher_weights import publish_teacher

    with CoordinatorClient(base, admin) as client:
        for run in runs:
            publish_teacher(client, teacher, run)


def _end_teacher_run(base: str, admin: str, run: str) -> None:
    """End `run`'s teacher rounds at the coordinator (its run is over): the workers stop consuming its queue, as
    they stop consuming an ended probe run's."""
    from coordinator.client import CoordinatorClient

    with CoordinatorClient(base, admin) as client:
        client.end_teacher(run)


def _serve_metrics(out: Path, coordinator_port: int, worker_ports: list[int], log: Callable[[str], None],
                   here: bool = True) -> int:
    """Serve the trainer's metrics on a free port (`here`: from this process, which trains; else the port is
    returned for the trainer's rank 0, `train --metrics-port`); write `out/prometheus.yml` scraping it, the
    coordinator and the workers (their `--metrics-port`). Returns the trainer's port."""
    from trainer import metrics as trainer_metrics

    local = "127.0.0.1:{}".format
    trainer_port = trainer_metrics.serve(0) if here else free_port()
    path = write_scrape_config(out / SCRAPE_CONFIG, {
        "coordinator": [local(coordinator_port)], "trainer": [local(trainer_port)],
        "probe-worker": [local(p) for p in worker_ports]})
    log(f"Prometheus: every service's /metrics is listed in {path} (prometheus --config.file={path}; "
        "ops/grafana's dashboard reads it)")
    return trainer_port


def _checkpoint_step(cfg) -> int | None:
    """The step of a run folder's newest checkpoint (a single process's file or a torchrun job's DCP folder)."""
    from trainer.checkpoint import checkpoint_step
    from trainer.dist_checkpoint import DCP_NAME, dcp_step
    from trainer.run_dir import CHECKPOINT_NAME

    steps = [checkpoint_step(cfg.run_dir / CHECKPOINT_NAME), dcp_step(cfg.run_dir / DCP_NAME)]
    return max((s for s in steps if s is not None), default=None)


def stopped_note(plan: UpPlan | None) -> str:
    """What an interrupted `up` says after every process stopped: each run's checkpointed step and the command that
    resumes (the same one). `plan` None: stopped before its options were checked."""
    import shlex

    again = shlex.join(["sparecycles", *sys.argv[1:]]) if sys.argv[1:2] == ["up"] else "the same command"
    if plan is None:
        return f"stopped before anything started; rerun {again}"
    done = []
    for name, cfg in (("adamw", plan.base_cfg), (plan.optimizer, plan.zo_cfg)):
        step = _checkpoint_step(cfg)
        done.append(f"{name} checkpointed at step {step} of {cfg.steps}" if step is not None else f"{name}: no checkpoint")
    return f"{'; '.join(done)}; resume with: {again}"


def resume_note(name: str, cfg) -> str:
    """The line `up` prints for an interrupted run it resumes: from which step (its checkpoint's) of how many."""
    step = _checkpoint_step(cfg)  # the newest resumes
    where = f"step {step} of {cfg.steps}" if step is not None else "its checkpoint"
    return f"{name}: resuming the interrupted run at {where} ({cfg.run_dir})"


def unfolded_warning(optimizer: str, records: list[dict]) -> str | None:
    """The warning for a ZO-Curv run whose probe rounds were sent but none completed before a refresh could fold
    it (its refresh records never carry the curvature estimate, `curv_median`): the fleet answered slower than
    the curvature interval, so the run equals AdamW. None otherwise (or for optimizers without rounds)."""
    refreshes = [r for r in records if "curv_pending_rounds" in r]
    if not refreshes or any("curv_median" in r for r in refreshes):
        return None
    pending = int(refreshes[-1]["curv_pending_rounds"])
    return (f"{optimizer} sent {len(refreshes)} probe round(s) but none completed before the next refresh "
            f"({pending} still pending at the last one): the fleet answered slower than --curvature-interval "
            "steps of the trainer, so this run equals AdamW. Use more --workers or a larger --curvature-interval.")


def late_rounds_warning(plan: UpPlan, records: list[dict]) -> str | None:
    """`unfolded_warning` for the fleet-probed run's metrics `records`, unless the plan already warned that the run
    is too short for its interval (trainer.preflight.TOO_SHORT): then the cause is the run's length, not the fleet."""
    from trainer.preflight import TOO_SHORT

    if any(w.startswith(TOO_SHORT) for w in plan.warnings):
        return None
    return unfolded_warning(plan.optimizer, records)


def _plot(plan: UpPlan, title: str) -> Path:
    from trainer.report import plot_accuracy_and_loss, plot_loss_curves, read_metrics

    runs = {name: read_metrics(plan.out / name / "metrics.jsonl") for name in ("adamw", plan.optimizer)}
    if plan.task != "sentiment":
        return plot_loss_curves(runs, plan.out / "loss_curves.png", title=title, unit="nats/token")
    from trainer.data import load_sentiment

    cfg = plan.zo_cfg  # evaluation scores min(eval_batches * batch_size, |val|) fixed sentences (trainer.sentiment)
    n_val = min(cfg.eval_batches * cfg.batch_size, len(load_sentiment().val))
    return plot_accuracy_and_loss(runs, plan.out / "curves.png", title=title, chance=0.5, n_val=n_val)


def run_up(plan: UpPlan, *, progress: bool = True, keep_blobs: bool = False, export: bool = True,
           log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """Carry out `plan` (from `plan_up`) and return its summary (also written, once, to `<out>/summary.json`).

    Finished runs with the same settings are reused (both finished: no service starts), interrupted ones
    resume from their checkpoints; the rest train: an AdamW backprop baseline in this process, then the
    fleet-probed run at equal steps. Afterwards the coordinator's blobs and the embedded Valkey's files are
    removed unless `keep_blobs`. With `export`, each run folder gets its finished model as a transformers folder
    `export/` (trainer.export). `log` receives progress lines and warnings.
    Raises RuntimeError if a service fails to start (the message names its log file); always stops every
    process it started.
    """
    for w in plan.warnings:
        log(f"warning: {w}")
    if plan.nproc is not None:
        from sparecycles.up_ranks import launch_note

        log(launch_note(plan))
    t0 = time.perf_counter()
    _prefetch_inputs(plan.zo_cfg, progress)  # first: a refusal found while reading the data leaves the folder as it was
    reused = _prepare_folder(plan, log)
    old = read_json(plan.out / "summary.json") or {}
    if len(reused) == 2:  # nothing to train: no service needed
        # Nothing ran this time: the summary says so, not the Valkey (or Redis) of the invocation that trained them.
        fleet, redis_desc, extra = old.get("fleet", {}), "not started (both runs reused)", {}
        if plan.serving is not None:
            log(f"--serving {plan.serving.engine}: no engine started (nothing to train)")
    else:
        fleet, redis_desc, extra = _train_beside_serving(plan, progress, log, export)
        fleet = fleet or old.get("fleet", {})  # the fleet-probed run was reused, only AdamW trained
    png = _plot(plan, title(plan))
    from trainer.report import read_metrics

    late = late_rounds_warning(plan, read_metrics(plan.out / plan.optimizer / "metrics.jsonl"))
    if late:
        log(f"warning: {late}")
    if not keep_blobs:  # a finished run never reads them again; a resumed one publishes afresh
        for name in ("blobs", "valkey"):
            shutil.rmtree(plan.out / name, ignore_errors=True)
    summary = build_summary(plan, UpOutcome(reused, fleet, redis_desc, extra),
                            rounds=_rounds_note(plan.optimizer, plan.fleet_wait), teacher=teacher_note(plan),
                            late=late, png=png, wall_s=time.perf_counter() - t0)
    for w in summary["warnings"][len(plan.warnings) + bool(late):]:
        log(f"warning: {w}")
    return write_summary(plan.out, summary)


def _prepare_folder(plan: UpPlan, log: Callable[[str], None]) -> list[str]:
    """Clear the run folder if the plan says so, write its settings, drop an earlier `--serving` run's serving.json
    when this one serves nothing; log and return the finished runs reused."""
    out = plan.out
    if plan.clear:
        clear_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / UP_SETTINGS).write_text(json.dumps(plan.settings, indent=2))
    if plan.serving is None:  # an earlier `up --serving` in this --run-dir: its figures are not this run's
        (out / SERVING_JSON).unlink(missing_ok=True)
    reused = [name for name, st in plan.states.items() if st.kind == "done"]
    for name in reused:
        log(f"{name}: reusing the finished run in {out / name} (same settings; --overwrite trains it again)")
    return reused


def _train_beside_serving(plan: UpPlan, progress: bool, log: Callable[[str], None],
                          export: bool) -> tuple[dict, str, dict]:
    """Train the runs not finished with the fleet, beside `--serving`'s engine and load if any. Returns (fleet figures,
    Redis description, the summary's extra entries: `serving`, serving.json's figures less every request)."""
    from sparecycles.up_serving import serving_beside

    with serving_beside(plan.serving, plan.out, log) as serving:  # --serving: an engine and its load beside the fleet
        fleet, redis_desc = _train_with_fleet(plan, progress, log, export, serving)
    if serving is None:
        return fleet, redis_desc, {}
    figures = {k: v for k, v in serving.figures().items() if k not in ("requests", "requests_alone")}
    return fleet, redis_desc, {"serving": figures}
