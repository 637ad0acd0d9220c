"""`python -m experiments.regime run|report`: the block-type lr plan (experiments.regime.cli)."""

from experiments.regime.cli import regime_app

regime_app(prog_name="python -m experiments.regime")
