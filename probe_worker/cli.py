"""`sparecycles worker`: join a coordinator's fleet as a probe worker for one device.

Imports only typer and the standard library at module top so `sparecycles --help` stays fast; the
worker machinery (torch, Celery) is imported inside the command.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer


def worker(
    coordinator: str = typer.Option(..., "--coordinator", envvar="SPARECYCLES_COORDINATOR",
                                    help="Coordinator base URL, e.g. http://10.0.0.5:8000"),
    token: str = typer.Option(..., "--token", envvar="SPARECYCLES_ENROLLMENT_TOKEN",
                              help="Enrollment token (from the coordinator's operator)"),
    device: str = typer.Option("cpu", "--device", help="Torch device: cpu or cuda:N (one worker per GPU)"),
    name: Optional[str] = typer.Option(None, "--name", help="Name shown in GET /v1/workers"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus metrics here"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Weight cache (default: cache root/worker)"),
    keep_versions: int = typer.Option(2, "--keep-versions", min=1, help="Weight versions kept loaded"),
    control_interval: float = typer.Option(0.5, "--control-interval", min=0.05,
                                           help="Seconds between heartbeats / drain checks"),
    soft_shutdown: float = typer.Option(30.0, "--soft-shutdown", min=0.0,
                                        help="Seconds SIGTERM waits for the in-flight task"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's)"),
    loglevel: str = typer.Option("INFO", "--loglevel"),
) -> None:
    """Register with the coordinator and evaluate probe tasks until SIGTERM (SIGUSR1 drains, SIGUSR2 resumes)."""
    if not device.startswith(("cpu", "cuda")):
        raise typer.BadParameter("use cpu or cuda:N", param_hint="--device")
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from probe_worker.worker import ProbeWorker, WorkerOptions

    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{device} requested but CUDA is not available", param_hint="--device")
    opts = WorkerOptions(
        coordinator=coordinator, token=token, device=device, name=name, metrics_port=metrics_port,
        cache_dir=cache_dir, keep_versions=keep_versions, control_interval_s=control_interval,
        soft_shutdown_s=soft_shutdown, loglevel=loglevel.upper(),
    )
    ProbeWorker(opts).run()


if __name__ == "__main__":
    typer.run(worker)
