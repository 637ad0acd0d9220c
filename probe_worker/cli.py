"""`sparecycles worker`: join a coordinator's fleet as a probe worker for one device.

Imports only typer and the standard library at module top so `sparecycles --help` stays fast; the
worker machinery (torch, Celery) is imported inside the command.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer


def worker(
    coordinator: Annotated[str, typer.Option("--coordinator", envvar=["SPARECYCLES_COORDINATOR_URL", "SPARECYCLES_COORDINATOR"],
                                             help="Coordinator base URL, e.g. http://10.0.0.5:8000")],
    token: Annotated[str, typer.Option("--token", envvar="SPARECYCLES_ENROLLMENT_TOKEN",
                                       help="Enrollment token (from the coordinator's operator)")],
    device: Annotated[str, typer.Option(help="Torch device: cpu or cuda:N (one worker per GPU)")] = "cpu",
    name: Annotated[str | None, typer.Option(help="Name shown in GET /v1/workers")] = None,
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help="Serve Prometheus metrics on this "
                                                     "port (default: none; 0: none, as `train`'s)")] = None,
    metrics_host: Annotated[str, typer.Option(help="Interface the metrics port binds (0.0.0.0 in containers, "
                                              "where Prometheus scrapes it from another one)")] = "127.0.0.1",
    cache_dir: Annotated[Path | None, typer.Option(help="Weight cache (default: cache root/worker)")] = None,
    keep_versions: Annotated[int, typer.Option(min=1, help="Weight versions kept loaded")] = 2,
    blob_dir: Annotated[Path | None, typer.Option(envvar="SPARECYCLES_BLOB_DIR", help="The coordinator's blob "
                                                  "directory, when this worker shares its file system: weight "
                                                  "shards are read there in place instead of downloaded")] = None,
    control_interval: Annotated[float, typer.Option(min=0.05, help="Seconds between heartbeats/drain checks")] = 0.5,
    soft_shutdown: Annotated[float, typer.Option(min=0.0, help="Seconds SIGTERM waits for the in-flight task")] = 30.0,
    prefetch_interval: Annotated[float, typer.Option(min=0.0, help="Seconds between checks for a new version "
                                                     "to load ahead of its rounds (with one run: back-to-back 2 s "
                                                     "long polls instead; 0: load at the first task)")] = 1.0,
    yield_gpu_util: Annotated[float | None, typer.Option(min=1.0, max=100.0, help="Drain while other work keeps "
                                                          "the GPU at least this busy (percent; needs "
                                                          "nvidia-ml-py)")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads (default: torch's)")] = None,
    probe_path: Annotated[str, typer.Option(help="auto (a whole-model scratch copy when it fits in free memory, "
                                            "else per-unit), whole or per_unit")] = "auto",
    cuda_graphs: Annotated[bool, typer.Option(help="Replay the compiled forwards as CUDA graphs (shapes are "
                                              "static per round)")] = False,
    tf32_attention: Annotated[str, typer.Option(help="Attention of the fp32/TF32 kinds' forwards: auto (bf16 on "
                                                "CUDA, fp32 on CPU), fp32, or bf16 (activations only; the weights "
                                                "and their perturbation stay fp32; docs/RESULTS.md has its "
                                                "signal-to-noise)")] = "auto",
    teacher_engine: Annotated[str | None, typer.Option(help="Answer teacher rounds (--kd-estimator topk) through "
                                                       "this serving engine's OpenAI-compatible API, never "
                                                       "loading the teacher (docs/engine-teacher.md)")] = None,
    teacher_queue: Annotated[list[str] | None, typer.Option(help="A teacher round queue to consume with "
                                                            "--teacher-engine (repeatable; `train` prints it)")] = None,
    loglevel: Annotated[str, typer.Option(help="Log level (DEBUG, INFO, WARNING)")] = "INFO",
    serving_metrics: Annotated[str | None, typer.Option(envvar="SPARECYCLES_SERVING_METRICS",
                                                        help="Yield to the serving engine beside this worker: its "
                                                        "Prometheus endpoint, e.g. http://127.0.0.1:8000/metrics, "
                                                        "read every control interval (docs/serving.md)")] = None,
    serving_engine: Annotated[str | None, typer.Option(help="Whose queue gauges to read: auto, vllm, sglang, tgi "
                                                       "or llamacpp (default: auto)")] = None,
    serving_gauge: Annotated[list[str] | None, typer.Option(help="A gauge to read instead (repeatable; any "
                                                            "engine)")] = None,
    serving_busy_above: Annotated[float | None, typer.Option(help="The engine is busy while its gauges sum above "
                                                             "this (requests; default 0)")] = None,
    serving_hold: Annotated[float | None, typer.Option(envvar="SPARECYCLES_SERVING_HOLD",
                                                       help="Seconds the engine must read idle before the worker "
                                                       "takes tasks again (default in docs/serving.md)")] = None,
    task_trace: Annotated[Path | None, typer.Option(help="Append each task's start, end and outcome there "
                                                    "(JSON lines; `bench serving` plots them)")] = None,
) -> None:
    """Register with the coordinator and evaluate probe tasks until SIGTERM (SIGUSR1 drains, SIGUSR2 resumes)."""
    if not coordinator.startswith(("http://", "https://")):
        raise typer.BadParameter(f"the coordinator's base URL must be http(s)://..., got {coordinator!r}",
                                 param_hint="--coordinator")
    if not device.startswith(("cpu", "cuda")):
        raise typer.BadParameter("use cpu or cuda:N", param_hint="--device")
    if tf32_attention not in ("auto", "fp32", "bf16"):
        raise typer.BadParameter("use auto, fp32 or bf16", param_hint="--tf32-attention")
    if probe_path not in ("auto", "whole", "per_unit"):
        raise typer.BadParameter("use auto, whole or per_unit", param_hint="--probe-path")
    from coordinator.settings import NEW_SECRET_HINT, DevMode, secret_problem

    if not DevMode().dev_mode and (why := secret_problem(token)):
        raise typer.BadParameter(f"the enrollment token (SPARECYCLES_ENROLLMENT_TOKEN) {why}; use the coordinator's "
                                 f"(its operator made it with {NEW_SECRET_HINT}), or SPARECYCLES_DEV_MODE=1 for local "
                                 "experiments only", param_hint="--token")
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # one line per heartbeat
    import torch

    from probe_worker.worker import ProbeWorker, WorkerOptions

    if threads:
        torch.set_num_threads(threads)
    if yield_gpu_util is not None and not device.startswith("cuda"):
        raise typer.BadParameter("--yield-gpu-util needs --device cuda:N", param_hint="--yield-gpu-util")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{device} requested but CUDA is not available", param_hint="--device")
    if device.startswith("cuda"):
        # fp32 weights (the trainer's published master values) are evaluated with TF32 matmuls, the precision
        # the trainer itself trains at on CUDA (trainer.train), for the kinds declared "tf32"; the kinds declared
        # "bf16" (trainer.zo.probes.KINDS, from `bench precision`: docs/RESULTS.md) run a bf16 compiled copy.
        torch.set_float32_matmul_precision("high")
    serving = None
    if serving_metrics is not None:
        serving = _serving_policy(serving_metrics, serving_engine, serving_gauge, serving_busy_above, serving_hold)
    elif any(v is not None for v in (serving_engine, serving_gauge, serving_busy_above, serving_hold)):
        raise typer.BadParameter("the --serving-* options need --serving-metrics URL", param_hint="--serving-metrics")
    if bool(teacher_engine) != bool(teacher_queue) or not (teacher_engine or "http").startswith("http"):
        raise typer.BadParameter("--teacher-engine http(s)://... and --teacher-queue go together",
                                 param_hint="--teacher-engine")
    opts = WorkerOptions(
        coordinator=coordinator, token=token, device=device, name=name, metrics_port=metrics_port,
        metrics_host=metrics_host,
        cache_dir=cache_dir, keep_versions=keep_versions, shared_blob_dir=blob_dir, control_interval_s=control_interval,
        soft_shutdown_s=soft_shutdown, prefetch_interval_s=prefetch_interval, yield_gpu_util_pct=yield_gpu_util,
        probe_path=probe_path, cuda_graphs=cuda_graphs, tf32_attention=tf32_attention, loglevel=loglevel.upper(),
        serving=serving, teacher_engine=teacher_engine, teacher_queues=tuple(teacher_queue or ()),
        task_trace=task_trace,
    )
    import httpx

    from coordinator.client import CoordinatorHTTPError

    try:
        ProbeWorker(opts).run()
    except (httpx.HTTPError, CoordinatorHTTPError) as exc:
        # Registration is retried with backoff inside; reaching here means the coordinator is unreachable
        # or refused the token: say so in one line instead of a traceback.
        typer.secho(f"error: cannot join {coordinator}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _serving_policy(url: str, engine: str | None, gauges: list[str] | None, busy_above: float | None,
                    hold: float | None):
    """The ServingPolicy of the --serving-* options (unset ones take the model's defaults); BadParameter if invalid."""
    from pydantic import ValidationError

    from probe_worker.serving import ServingPolicy

    given = {"metrics_url": url, "engine": engine, "gauges": tuple(gauges) if gauges else None,
             "busy_above": busy_above, "hold_s": hold}
    try:
        return ServingPolicy(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise typer.BadParameter(str(exc), param_hint="--serving-*") from None


if __name__ == "__main__":
    typer.run(worker)
