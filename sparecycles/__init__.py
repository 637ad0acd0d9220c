"""sparecycles: the application shell (CLI) over coordinator/, api/, probe_worker/, trainer/ and probe_kernels/."""

__version__ = "0.1.0"

# The public loop API (sparecycles.loop), imported on first use: `import sparecycles` stays light for the CLI.
_LOOP = ("AnytimeModel", "Evaluation", "EvalWindows", "Fleet", "FleetError", "VersionChannel", "ZOCurv", "connect",
         "lm_loss", "lm_windows")
__all__ = ["__version__", *_LOOP]


def __getattr__(name: str):
    if name in _LOOP:
        from sparecycles import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'sparecycles' has no attribute {name!r}")
