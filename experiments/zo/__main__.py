"""`python -m experiments.zo [OPTIONS]`: the ZO side-by-side benchmarks (experiments.zo.cli)."""

from experiments.zo.cli import app

app(prog_name="python -m experiments.zo")
