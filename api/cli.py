"""`sparecycles coordinator`: serve the REST API with uvicorn (imports only typer at module top)."""

from __future__ import annotations

import typer


def coordinator(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 in containers)."),
    port: int = typer.Option(8787, min=1, max=65535, help="TCP port."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve the coordinator API. Settings come from SPARECYCLES_* environment variables (and REDIS_URL);
    it refuses to start with empty or default secrets unless SPARECYCLES_DEV_MODE=1."""
    import uvicorn
    from pydantic import ValidationError

    from api.app import create_app
    from coordinator.settings import CoordinatorSettings

    try:
        settings = CoordinatorSettings()
    except ValidationError as exc:
        # Never echo input values: they are secrets.
        reasons = "; ".join(e["msg"] for e in exc.errors(include_input=False, include_url=False))
        typer.echo(f"refusing to start: {reasons}", err=True)
        raise typer.Exit(2) from exc
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level=log_level,
        proxy_headers=True,
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    typer.run(coordinator)
