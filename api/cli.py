"""`sparecycles coordinator`: serve the REST API with uvicorn.

`CoordinatorOptions` declares its options, each with its default and bound; the top layer (sparecycles.cli) generates
them into the command (trainer.cli_settings, which this torch-free layer may not import) and hands `coordinator` the
values given. Imports only typer and pydantic at module top.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
LogLevel = Annotated[Literal[LOG_LEVELS],  # type: ignore[valid-type]
                     BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)]  # INFO is info


class CoordinatorOptions(BaseModel):
    """`coordinator`'s options (the server's own settings come from SPARECYCLES_* variables: CoordinatorSettings).
    Raises pydantic.ValidationError for a value outside its choices or bounds, naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="Interface to bind (0.0.0.0 in containers)")
    port: int = Field(8787, ge=1, le=65535, description="TCP port")
    log_level: LogLevel = Field("info", description="uvicorn log level: critical, error, warning, info, debug or "
                                "trace (access lines are info: --access-log shows them at info and below)")
    access_log: bool = Field(False, description="Log one line per HTTP request (uvicorn's access log; off by "
                             "default: at thousands of results/s it costs the coordinator CPU; rejections are "
                             "counted in /metrics either way)")
    workers: int = Field(1, ge=1, le=64, description="Coordinator processes sharing the port, each a uvicorn server "
                         "with its own SO_REUSEPORT listener. Above 1, /metrics sums every process's counters "
                         "through prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a fresh temporary "
                         "directory unless set; its *.db files are cleared at start)")
    check: bool = Field(False, description="Only check the settings from the environment (its secrets included) "
                        "and exit: 0 when the coordinator would start, 2 naming each refused variable (the compose "
                        "files' one-shot `check` service, which every other service waits for)")


def coordinator(given: dict[str, Any]) -> None:
    """Serve the coordinator API. Settings come from SPARECYCLES_* environment variables (and REDIS_URL);
    it refuses to start with empty, short, default or placeholder secrets (naming the variable) unless
    SPARECYCLES_DEV_MODE=1."""
    import contextlib
    import os
    import socket
    import tempfile
    from pathlib import Path

    import uvicorn
    from pydantic import ValidationError

    from coordinator.settings import CoordinatorSettings, settings_problems

    o = CoordinatorOptions(**given)  # each value was checked, naming its option, when the command line was parsed
    try:
        CoordinatorSettings()  # fail here, once, with a clear message (each worker process re-reads it)
    except ValidationError as exc:
        # Each reason names its environment variable; never the input values: they are secrets.
        typer.echo(f"refusing to start: {'; '.join(settings_problems(exc, CoordinatorSettings))}", err=True)
        raise typer.Exit(2) from exc
    if o.check:
        typer.echo("settings accepted: the coordinator, its workers and the trainer may start", err=True)
        return
    with contextlib.ExitStack() as stack:
        if o.workers > 1:
            # Must be in the environment before a worker process imports prometheus-client.
            mp = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if mp:
                Path(mp).mkdir(parents=True, exist_ok=True)
                for stale in Path(mp).glob("*.db"):  # values of a previous run would be summed in
                    stale.unlink()
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="sparecycles-metrics-"))
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp
        options = {
            "factory": True,
            "log_level": o.log_level,
            "access_log": o.access_log,
            "proxy_headers": True,
            "timeout_graceful_shutdown": 10,
        }
        if o.workers > 1 and hasattr(socket, "SO_REUSEPORT"):
            from api.server import serve_processes

            raise typer.Exit(
                serve_processes("api.app:app_from_env", host=o.host, port=o.port, workers=o.workers, **options)
            )
        with _stop_status() as stopped:
            uvicorn.run("api.app:app_from_env", host=o.host, port=o.port, workers=o.workers, **options)
        if stopped:
            raise typer.Exit(128 + stopped[0])


@contextmanager
def _stop_status() -> Iterator[list[int]]:
    """Note the signal (SIGINT or SIGTERM) that stops the server in the yielded list, for exit status 128 + it (130
    after Ctrl-C, 143 after SIGTERM, as `train`, `up` and `fleet` end). uvicorn installs its own handlers while it
    serves and, once shut down, restores these and raises the signal again: the handler then notes it and raises
    KeyboardInterrupt, caught here (before uvicorn serves, the same stops start-up at once). The previous handlers
    come back on exit."""
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    except KeyboardInterrupt:
        if not stopped:
            stopped.append(signal.SIGINT)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)

