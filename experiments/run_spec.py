"""What the full-schedule comparison benchmarks (experiments.regime.plan, experiments.zocurv_fair.fair) share about one run:
its optimizer options in one hashable order, the options' part of its folder name, and training it into its folder.

A run's folder name keys its results on disk (`summary.json`, `metrics.jsonl`, `spec.json`), so `options_suffix`
must keep spelling the options exactly as the earlier calls did: "-{key}{value}" per pair, in key order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any


class OptionsRun:
    """Mixin for a frozen dataclass with an `options` field (optimizer_options of trainer.methods as (key, value)
    pairs) and a `name` (its folder)."""

    options: tuple[tuple[str, Any], ...]
    name: str

    def __post_init__(self) -> None:  # JSON gives lists: keep the pairs hashable and in one order
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in self.options)))

    @property
    def options_suffix(self) -> str:
        """The options' part of the run's folder name: "-{key}{value}" per pair, sorted by key ("" for none)."""
        return "".join(f"-{k}{v}" for k, v in self.options)


def train_into(spec: OptionsRun, out_dir: Path, config: Callable[[Path], Any],
               micro_batch_size: int | None = None) -> None:
    """Train `spec` into out_dir/spec.name: spec.json (the dataclass as JSON) beside the run's files, the
    TrainConfig from `config(run_dir)`, overwriting an earlier partial run; the checkpoint removed afterwards
    (the comparison reads only summary.json and metrics.jsonl). `micro_batch_size`: sequences per
    forward/backward, each step's gradients accumulated over the batch (trainer.distributed: the same global batch
    in less activation memory); None: the whole batch at once. Raises ValueError when it does not divide the batch."""
    from trainer.distributed import setup
    from trainer.train import train

    run_dir = out_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(asdict(spec)))
    cfg = config(run_dir)
    dist = setup(device=cfg.device, micro_batch_size=micro_batch_size)
    train(cfg, progress=False, overwrite=True, export=False, dist=dist)
    (run_dir / "checkpoint.safetensors").unlink(missing_ok=True)


def plan_parser(prog: str, plans: Any, *, device: tuple[str, str, str | None], deadline_s: float,
                one: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """experiments.zocurv_fair.fair's command line (experiments.regime.plan's is typed: experiments.regime.cli): `run --plan P --out DIR --jobs J --<device> D --deadline-s S`,
    `report OUT [MORE…]` and `one <one…>` (one run, as a subprocess of `run`). `device` is (option name, default,
    help). Returns (the parser, the run and the report subparsers), for each benchmark to add its own options."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--plan", choices=sorted(plans), required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--jobs", type=int, default=4)
    r.add_argument(f"--{device[0]}", default=device[1], help=device[2])
    r.add_argument("--deadline-s", type=float, default=deadline_s)
    rep = sub.add_parser("report")
    rep.add_argument("out", type=Path, help="writes the summary and its figures here; reads its run folders")
    rep.add_argument("more", type=Path, nargs="*", help="further folders of run folders")
    one_p = sub.add_parser("one")
    for name in one:
        one_p.add_argument(name)
    return ap, r, rep


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root: `python -m experiments...` runs from there
