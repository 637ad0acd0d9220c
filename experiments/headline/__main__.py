"""`python -m experiments.headline report|memory`: the headline report and memory scan (experiments.headline.cli)."""

from experiments.headline.cli import headline_app

headline_app(prog_name="python -m experiments.headline")
