"""The `sparecycles` console script.

Each subcommand lives in the `cli` module of the package that owns it; those modules import only typer
(and the standard library) at import time, so `sparecycles coordinator --help` never imports torch.
"""

from __future__ import annotations

import typer

from trainer import cli as trainer_cli

app = typer.Typer(
    name="sparecycles",
    help="Train language models with the forward-only compute idle inference GPUs leave: "
    "zeroth-order probes for curvature (ZO-Curv) and memory-light ZO training (1SPSA, 1.5-SPSA, MeZO).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks (kernels, intake, fleet).", no_args_is_help=True)
app.add_typer(trainer_cli.data_app, name="data")
app.command("train")(trainer_cli.train)
app.add_typer(bench_app, name="bench")


def _register_optional() -> None:
    """Attach commands whose owning packages exist; each import is cheap (typer only)."""
    import importlib

    for module, attr, kind, name in [
        ("kernels.cli", "bench_kernels", "bench", "kernels"),
        ("api.cli", "coordinator", "app", "coordinator"),
        ("coordinator.cli", "bench_intake", "bench", "intake"),
        ("probe_worker.cli", "worker", "app", "worker"),
    ]:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        target = app if kind == "app" else bench_app
        target.command(name)(getattr(mod, attr))


_register_optional()


@app.command("version")
def version() -> None:
    """Print the installed version."""
    from sparecycles import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
