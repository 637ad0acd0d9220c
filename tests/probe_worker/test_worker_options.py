"""WorkerOptions (probe_worker.options): every option of `sparecycles worker`, one typed model with one default and
one bound each; its cross-option rules are validators, tested here without the CLI; the command's options are
generated from it (trainer.cli_settings), each flag of the hand-declared command kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.main import get_command

from probe_worker.options import WorkerOptions
from sparecycles.cli import app
from trainer.cli_settings import collect, table

WORKER = get_command(app).commands["worker"]  # type: ignore[attr-defined]
BASE = {"coordinator": "http://127.0.0.1:8000", "token": "t"}


@pytest.mark.parametrize(("given", "message"), [
    ({"coordinator": "ftp://h"}, "the coordinator's base URL must be http(s)://"),
    ({"device": "gpu"}, "use cpu or cuda:N"),
    ({"yield_gpu_util": 50.0}, "--yield-gpu-util needs --device cuda:N"),
    ({"serving": {"hold_s": 3.0}}, "the --serving-* options need --serving-metrics URL"),
    ({"serving": {"metrics_url": "http://h/metrics", "hold_s": -1}}, "greater than or equal to 0"),
    ({"teacher_engine": "h:8000", "teacher_queues": ("q",)}, "use http"),
    ({"teacher_pause": -1.0}, "greater than or equal"),
    ({"log_level": "loud"}, "use DEBUG, INFO"),
    ({"probe_path": "fast"}, "'auto', 'whole' or 'per_unit'"),
    ({"tf32_attention": "fp16"}, "'auto', 'fp32' or 'bf16'"),
    ({"control_interval": 0.01}, "greater than or equal to 0.05"),
    ({"metrics_port": 70000}, "less than or equal to 65535"),
    ({"keep_versions": 0}, "greater than or equal to 1"),
    ({"yield_gpu_util": 101.0, "device": "cuda:0"}, "less than or equal to 100"),
    ({"surprise": 1}, "Extra inputs are not permitted"),
])
def test_validators_refuse_naming_the_option(given, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        WorkerOptions(**{**BASE, **given})


def test_what_the_rules_accept():
    alone = WorkerOptions(**BASE)
    assert (alone.device, alone.keep_versions, alone.control_interval, alone.serving, alone.log_level) == (
        "cpu", 2, 0.5, None, "INFO")
    full = WorkerOptions(**BASE, device="cuda:1", yield_gpu_util=80.0, log_level="debug", teacher_engine="http://e:1",
                         teacher_queues=("q1", "q2"), serving={"metrics_url": "http://e:1/metrics", "gauges": ("g",)})
    assert full.log_level == "DEBUG" and full.teacher_queues == ("q1", "q2")
    assert full.serving is not None and full.serving.gauges == ("g",) and full.serving.hold_s == 2.0


def test_every_command_spells_its_log_level_option_log_level():
    """One spelling of the log level option, `--log-level` (`coordinator`'s, uvicorn's): `worker` took `--loglevel`
    (Celery's spelling) and refused `--log-level`; no deployment file or doc used `--loglevel`, so no alias keeps it
    (its refusal names --log-level). `worker --log-level debug` parses to WorkerOptions.log_level DEBUG."""
    from typer.main import get_command

    def flags(cmd, path=()):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from flags(sub, (*path, name))
        for p in getattr(cmd, "params", ()):
            for flag in (*p.opts, *p.secondary_opts):
                if "level" in flag:
                    yield " ".join(path), flag

    spelled = set(flags(get_command(app)))
    assert {("coordinator", "--log-level"), ("worker", "--log-level")} <= spelled
    assert {flag for _, flag in spelled} == {"--log-level"}, spelled
    values = WORKER.make_context("worker", ["--coordinator", "http://h:1", "--token", "t", "--log-level", "debug"]).params
    by_name = table(WorkerOptions)
    assert WorkerOptions(**collect({k: v for k, v in values.items() if k in by_name}, by_name)).log_level == "DEBUG"
    from typer.testing import CliRunner

    old = CliRunner().invoke(app, ["worker", "--coordinator", "http://h:1", "--token", "t", "--loglevel", "INFO"])
    assert old.exit_code == 2 and "No such option: --loglevel (Possible options: --log-level)" in old.output, old.output


def test_soft_shutdown_help_says_what_celery_does_with_it():
    """`--soft-shutdown` is Celery's worker_soft_shutdown_timeout (soft shutdown on idle too), which Celery >= 5.5
    applies to a cold shutdown only (SIGQUIT, a second Ctrl-C), its wait run on the solo pool's one thread; SIGTERM is
    a warm shutdown that waits for the running task without any limit. Its help said "seconds SIGTERM waits for the
    in-flight task": SIGTERM never used it. Checked against the installed Celery's signal handlers."""
    from celery.apps import worker as celery_worker

    from coordinator.celery_app import make_celery

    conf = make_celery("redis://127.0.0.1:1/0", soft_shutdown_s=7.0).conf
    assert (conf.worker_soft_shutdown_timeout, conf.worker_enable_soft_shutdown_on_idle) == (7.0, True)
    assert celery_worker.install_worker_term_handler.keywords == {"sig": "SIGTERM", "how": "Warm"}
    assert celery_worker.install_worker_term_hard_handler.keywords["how"] == "Cold"
    assert celery_worker.install_worker_term_hard_handler.keywords["callback"] is celery_worker.on_cold_shutdown
    text = " ".join(next(p for p in WORKER.params if p.name == "soft_shutdown").help.split())
    assert text.startswith("seconds a cold shutdown (SIGQUIT, or a second Ctrl-C) waits, idle or not, before it cuts "
                           "the running task"), text
    assert "SIGTERM, a warm shutdown, does not use it: the worker takes no further task and waits for the running " \
        "one however long it takes" in text, text


def test_the_command_is_generated_from_the_model_with_every_flag_kept():
    """The flags of the hand-declared command (before WorkerOptions; --loglevel since spelled --log-level, as
    `coordinator` spells it), their env vars, and what they parse to."""
    flags = {o for p in WORKER.params for o in (*p.opts, *p.secondary_opts)}
    kept = ("--coordinator --token --device --name --metrics-port --metrics-host --cache-dir --keep-versions "
            "--blob-dir --control-interval --soft-shutdown --prefetch-interval --yield-gpu-util --threads "
            "--probe-path --cuda-graphs --tf32-attention --teacher-engine --teacher-queue --log-level "
            "--serving-metrics --serving-engine --serving-gauge --serving-busy-above --serving-hold --task-trace")
    assert set(kept.split()) <= flags and "--no-cuda-graphs" in flags
    envvars = {p.name: p.envvar for p in WORKER.params if p.envvar}
    assert envvars == {"coordinator": ["SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_COORDINATOR"],
                       "token": "SPARECYCLES_ENROLLMENT_TOKEN", "blob_dir": "SPARECYCLES_BLOB_DIR",
                       "serving_metrics": "SPARECYCLES_SERVING_METRICS", "serving_hold": "SPARECYCLES_SERVING_HOLD"}
    ctx = WORKER.make_context("worker", [
        "--coordinator", "http://h:1", "--token", "t", "--teacher-engine", "http://e:2", "--teacher-queue", "a",
        "--teacher-queue", "b", "--serving-metrics", "http://e:2/metrics", "--serving-gauge", "g1",
        "--serving-hold", "1.5", "--cache-dir", "/tmp/c", "--cuda-graphs", "--device", "cuda:0"])
    by_name = table(WorkerOptions)
    seen = collect({k: v for k, v in ctx.params.items() if k in by_name}, by_name)
    opts = WorkerOptions(**seen)
    assert opts.teacher_queues == ("a", "b") and opts.cache_dir == Path("/tmp/c") and opts.cuda_graphs
    assert opts.serving is not None and (opts.serving.gauges, opts.serving.hold_s) == (("g1",), 1.5)
    assert str(opts.serving.metrics_url) == "http://e:2/metrics"
