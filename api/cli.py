"""`sparecycles coordinator`: serve the REST API with uvicorn (imports only typer at module top)."""

from __future__ import annotations

import typer


def coordinator(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 in containers)."),
    port: int = typer.Option(8787, min=1, max=65535, help="TCP port."),
    log_level: str = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug or trace "
                                  "(access lines are info: --access-log shows them at info and below)."),
    access_log: bool = typer.Option(
        False, help="Log one line per HTTP request (uvicorn's access log; off by default: at thousands of "
        "results/s it costs the coordinator CPU; rejections are counted in /metrics either way)."
    ),
    workers: int = typer.Option(
        1,
        min=1,
        max=64,
        help="Coordinator processes sharing the port, each a uvicorn server with its own SO_REUSEPORT "
        "listener. Above 1, /metrics sums every process's counters through prometheus-client's "
        "multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a fresh temporary directory unless set; its *.db "
        "files are cleared at start).",
    ),
) -> None:
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

    if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise typer.BadParameter(f"one of critical, error, warning, info, debug, trace; got {log_level!r}",
                                 param_hint="--log-level")
    log_level = log_level.lower()

    try:
        CoordinatorSettings()  # fail here, once, with a clear message (each worker process re-reads it)
    except ValidationError as exc:
        # Each reason names its environment variable; never the input values: they are secrets.
        typer.echo(f"refusing to start: {'; '.join(settings_problems(exc, CoordinatorSettings))}", err=True)
        raise typer.Exit(2) from exc
    with contextlib.ExitStack() as stack:
        if workers > 1:
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
            "log_level": log_level,
            "access_log": access_log,
            "proxy_headers": True,
            "timeout_graceful_shutdown": 10,
        }
        if workers > 1 and hasattr(socket, "SO_REUSEPORT"):
            from api.server import serve_processes

            raise typer.Exit(
                serve_processes("api.app:app_from_env", host=host, port=port, workers=workers, **options)
            )
        uvicorn.run("api.app:app_from_env", host=host, port=port, workers=workers, **options)


if __name__ == "__main__":
    typer.run(coordinator)
