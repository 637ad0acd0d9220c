"""sparecycles: the application shell (CLI) over coordinator/, api/, probe_worker/, trainer/ and kernels/."""

__version__ = "0.1.0"
