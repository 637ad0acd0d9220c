"""`sparecycles worker`: join a coordinator's fleet as a probe worker for one device.

Every option is generated from probe_worker.options.WorkerOptions (trainer.cli_settings.with_settings, as `train`'s
from TrainConfig and RunOptions): one declaration per option, its rules the model's validators. Imports only typer,
pydantic and the standard library at module top so `sparecycles --help` stays fast; the worker machinery (torch,
Celery) is imported inside the command.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import typer

from probe_worker.options import WorkerOptions
from trainer.cli_settings import with_settings

SECTION = "How the worker runs (WorkerOptions)"


@with_settings(model=WorkerOptions, param="given", section=SECTION)
def worker(given: dict[str, Any]) -> None:
    """Register with the coordinator and evaluate probe tasks until SIGTERM (SIGUSR1 drains, SIGUSR2 resumes); a stop by
    SIGTERM exits 143, by Ctrl-C 130."""
    from probe_worker.drain_signals import hold_drain_signals

    hold_drain_signals()  # before torch, CUDA or Celery start a thread: every thread it starts holds them too
    opts = worker_options(given)
    _check_token(opts.token)
    logging.basicConfig(level=opts.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # one line per heartbeat
    _set_up_torch(opts)
    import httpx

    from coordinator.client import CoordinatorHTTPError
    from probe_worker.worker import ProbeWorker

    stopped = _note_stop()
    try:
        ProbeWorker.create(opts).run()
    except KeyboardInterrupt:  # Ctrl-C before Celery's own handlers took over (registration, start-up)
        stopped.append("SIGINT")
    except (httpx.HTTPError, CoordinatorHTTPError) as exc:
        # Registration is retried with backoff inside; reaching here means the coordinator is unreachable
        # or refused the token: say so in one line instead of a traceback.
        typer.secho(f"error: cannot join {opts.coordinator}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    if stopped:  # Celery's shutdown ends 0 (SIGTERM) or 1 (Ctrl-C): 128 + the signal, as the other commands
        raise typer.Exit(128 + signal.Signals[stopped[0]])


def _note_stop() -> list[str]:
    """A list that gets the name of each signal Celery shuts the worker down for ("SIGTERM", "SIGINT", "SIGQUIT";
    celery.signals.worker_shutting_down), for the exit status 128 + the first: 143 after SIGTERM, 130 after Ctrl-C."""
    from celery.signals import worker_shutting_down

    stopped: list[str] = []
    worker_shutting_down.connect(lambda sig=None, **_: stopped.append(str(sig)), weak=False)
    return stopped


def worker_options(given: dict[str, Any]) -> WorkerOptions:
    """WorkerOptions from the generated options' values; typer.BadParameter (exit 2) with the validators' message
    (naming the option) for a refused value or combination."""
    from pydantic import ValidationError

    from trainer.preflight import explain

    try:
        return WorkerOptions(**given)
    except ValidationError as exc:
        raise typer.BadParameter(explain(exc, WorkerOptions)) from None


def _check_token(token: str) -> None:
    """Refuse a well-known or placeholder enrollment token unless SPARECYCLES_DEV_MODE=1 (typer.BadParameter)."""
    from coordinator.settings import NEW_SECRET_HINT, DevMode, secret_problem

    if not DevMode().dev_mode and (why := secret_problem(token)):
        raise typer.BadParameter(f"the enrollment token (SPARECYCLES_ENROLLMENT_TOKEN) {why}; use the coordinator's "
                                 f"(its operator made it with {NEW_SECRET_HINT}), or SPARECYCLES_DEV_MODE=1 for local "
                                 "experiments only", param_hint="--token")


def _set_up_torch(opts: WorkerOptions) -> None:
    """torch's threads and matmul precision for `opts`; typer.BadParameter for a CUDA device on a machine without."""
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{opts.device} requested but CUDA is not available", param_hint="--device")
    if opts.device.startswith("cuda"):
        # fp32 weights (the trainer's published master values) are evaluated with TF32 matmuls, the precision
        # the trainer itself trains at on CUDA (trainer.train), for the kinds declared "tf32"; the kinds declared
        # "bf16" (trainer.zo.probes.KINDS, from `bench precision`: docs/RESULTS.md) run a bf16 compiled copy.
        torch.set_float32_matmul_precision("high")


if __name__ == "__main__":
    typer.run(worker)
