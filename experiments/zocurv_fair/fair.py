"""The fair AdamW vs ZO-Curv comparison of issue 17 (a benchmark, not a test).

Protocol (issue 17, "A fair comparison"): every run is a full schedule of its own length T — linear warmup
(5% or 10% of T), cosine to 0.1×peak at T, β = (0.9, 0.95), weight decay 0.1 (matrices), gradient clip
1.0 — and is scored by its validation loss at the end of that schedule (never at an intermediate point of
a longer one). AdamW's peak lr is bracketed on both sides. The target is AdamW(T_ref)'s final validation
loss at its best (lr, warmup) (mean over seeds when several ran there); a variant's step ratio is the
smallest T whose full schedule reaches the target, divided by T_ref (`step_ratio`; None when no T of the
grid reaches it), with a linear interpolation in T between the two bracketing grid points beside it.

Wall-clock: "trainer_wall_s" is the run's wall time minus the time its probes took (they would run on idle
workers); "probe_gpu_s" is that probe time. With several runs sharing one GPU both are inflated alike, so a
variant's wall ratio is taken against a best-setting AdamW run of the same plan (device call) when one ran.

Usage (one process per run, `jobs` at a time on one GPU, stopped at a deadline; `report` reads whatever
finished): `python -m experiments.zocurv_fair.fair run --plan h200 --out DIR --jobs 6 --deadline-s 400`, then
`python -m experiments.zocurv_fair.fair report DIR`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from experiments.run_spec import CHECKOUT, OptionsRun, plan_parser, train_into
from experiments.zocurv_fair.score import ADAMW, report, step_ratio, summarize, variant_key  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class FairRun(OptionsRun):
    """One full-schedule run of the comparison (name = its folder)."""

    optimizer: str
    lr: float
    steps: int
    warmup_frac: float = 0.1
    seed: int = 0
    plan: str = ""  # the plan (device call) that ran it: wall times compare only within one call
    options: tuple[tuple[str, Any], ...] = ()  # optimizer_options (trainer.methods), as sorted (key, value) pairs

    @property
    def name(self) -> str:
        wu = round(self.warmup_frac * 100)
        return f"{self.optimizer}-lr{self.lr:g}-T{self.steps}-wu{wu}-s{self.seed}{self.options_suffix}"


FAIR_DEFAULTS = {"eval_batches": 64, "curvature_interval": 50, "probe_budget": 151, "probe_batch_size": 8,
                 "eps": 0.1}  # a plan's settings may override them


def fair_config(spec: FairRun, settings: dict[str, Any], device: str, run_dir: Path | None):
    """The TrainConfig of `spec` under the issue-17 protocol (module docstring); eval every T/4 steps on the
    first `eval_batches`·batch_size held-out windows (trainer.data.iter_eval_batches: evenly spread).
    ZO defaults: a refresh every 50 steps with 151 forward-equivalents (DESIGN.md §2: one idle H200 buys ~3
    probe forwards per trainer step), probe batch 8 sequences, ε_G = 0.1·RMS(θ_G) (at 0.01 the fp32 loss
    rounding dominated h on gpt2-tiny: estimates flipped sign; 0.1 and 0.3 agreed). `settings`: model, corpus,
    batch_size and seq_len (a plan's), and any of FAIR_DEFAULTS to override."""
    from trainer.config import TrainConfig

    return TrainConfig(**{**FAIR_DEFAULTS, **settings}, optimizer=spec.optimizer, steps=spec.steps, lr=spec.lr,
                       min_lr=0.1 * spec.lr, warmup_steps=max(1, round(spec.warmup_frac * spec.steps)),
                       weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=max(1, spec.steps // 4),
                       checkpoint_every=10 * spec.steps, seed=spec.seed, device=device, run_dir=run_dir,
                       optimizer_options=dict(spec.options))


# Reduced H200 plan (600 s of device time for the whole call): T_ref = 400 steps of 16×512.
H200_SETTINGS = {"model": "gpt2-small", "corpus": "classics", "batch_size": 16, "seq_len": 512}
VARIANTS = ("zocurv-group-fixed", "zocurv-group", "zocurv-global")


def h200_plan(t_ref: int = 400, variant_lr: float = 6e-4) -> list[FairRun]:
    """AdamW at T_ref: lr 3e-4 … 2e-3 at warmup 10%, two lrs at 5%; each variant at T ∈ {1, ½, ¾}·T_ref
    (the fixed table also at half the base lr: its multipliers reach 10×). In priority order: a deadline
    drops the last ones (T = ¾·T_ref first: ½ is the goal's point)."""
    specs = [FairRun(ADAMW, lr, t_ref, 0.1) for lr in (3e-4, 6e-4, 1.2e-3, 2e-3)]
    specs += [FairRun(ADAMW, lr, t_ref, 0.05) for lr in (6e-4, 1.2e-3)]
    specs += [FairRun(VARIANTS[0], variant_lr / 2, t_ref, 0.1)]
    for frac in (1.0, 0.5, 0.75):
        specs += [FairRun(v, variant_lr, round(frac * t_ref), 0.1) for v in VARIANTS]
    return specs


def h200_followup_plan() -> list[FairRun]:
    """Second call (the first ran out of its deadline after the 6 AdamW and 2 fixed-table runs): the learned
    variants at T_ref and a second AdamW seed at the best setting of the first call (lr 6e-4, warmup 10%)."""
    return [FairRun("zocurv-group", 6e-4, 400), FairRun("zocurv-global", 6e-4, 400), FairRun(ADAMW, 6e-4, 400, seed=1)]


def cpu_plan() -> list[FairRun]:
    """A smoke plan for gpt2-tiny on CPU (checks the harness end to end)."""
    return [FairRun(ADAMW, 3e-3, 4), FairRun(ADAMW, 1e-2, 4), FairRun("zocurv-group", 3e-3, 4),
            FairRun("zocurv-group", 3e-3, 2)]


def final_plan(t_ref: int = 400, lr: float = 6e-4) -> list[FairRun]:
    """Third call (one H200, ~300 s of runs, all at once): AdamW's third seed at the best setting of the first
    two (lr 6e-4, warmup 10%, T_ref); zocurv-global at T = 350 (two seeds: the point that decides whether
    the ratio is below 1) and 300; AdamW at those T (seed 0, paired with zocurv-global's seed 0: same
    init and batches) for the variant-vs-AdamW gap at equal T and AdamW's own final-vs-T slope;
    zocurv-group-global at T_ref with the negative-curvature rule fixed ("skip", written out so spec.json
    records it). Longest first: the deadline would cut the last started."""
    short = [round(0.875 * t_ref), round(0.75 * t_ref)]
    return [FairRun("zocurv-group-global", lr, t_ref, options=(("negative", "skip"),)),
            FairRun(ADAMW, lr, t_ref, seed=2),
            *[FairRun(o, lr, short[0], seed=sd) for o, sd in (("zocurv-global", 0), ("zocurv-global", 1), (ADAMW, 0))],
            *[FairRun(o, lr, short[1]) for o in ("zocurv-global", ADAMW)]]


def cpu_final_plan() -> list[FairRun]:
    """`final_plan`'s code paths on gpt2-tiny on CPU (seeds, options, AdamW at several T, both probe kinds)."""
    return [FairRun(ADAMW, 3e-3, 4), FairRun(ADAMW, 1e-2, 4), FairRun(ADAMW, 3e-3, 4, seed=1),
            FairRun("zocurv-group-global", 3e-3, 4, options=(("negative", "skip"),)),
            FairRun("zocurv-global", 3e-3, 3), FairRun("zocurv-global", 3e-3, 3, seed=1), FairRun(ADAMW, 3e-3, 3)]


CPU_SETTINGS = {"model": "gpt2-tiny", "corpus": "classics-small", "batch_size": 2, "seq_len": 16, "eval_batches": 2,
                "curvature_interval": 2, "probe_budget": 11}
PLANS = {"h200": (h200_plan, H200_SETTINGS), "h200-followup": (h200_followup_plan, H200_SETTINGS),
         "h200-final": (final_plan, H200_SETTINGS), "cpu": (cpu_plan, CPU_SETTINGS),
         "cpu-final": (cpu_final_plan, CPU_SETTINGS)}


# ---- running -----------------------------------------------------------------------------------------
def run_one(spec: FairRun, settings: dict[str, Any], device: str, out_dir: Path) -> None:
    """Train one spec into out_dir/spec.name (experiments.run_spec.train_into)."""
    train_into(spec, out_dir, lambda run_dir: fair_config(spec, settings, device, run_dir))


def run_plan(plan: str, out_dir: Path, *, jobs: int, device: str, deadline_s: float) -> list[str]:
    """Run the plan's specs as subprocesses, `jobs` at a time; past the deadline stop what still runs.
    Returns the names of the runs that did not finish (no summary.json)."""
    queue = [replace(s, plan=plan) for s in PLANS[plan][0]()]
    out_dir.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + deadline_s
    running: list[tuple[subprocess.Popen, FairRun]] = []
    unfinished: list[str] = []
    while queue or running:
        while queue and len(running) < jobs and time.monotonic() < t_end:
            spec = queue.pop(0)
            log = (out_dir / f"{spec.name}.log").open("w")
            cmd = [sys.executable, "-m", "experiments.zocurv_fair.fair", "one", json.dumps(asdict(spec)), plan,
                   str(out_dir), device]
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT), spec))
        if time.monotonic() >= t_end:
            unfinished += [s.name for s in queue]
            queue.clear()
            for p, s in running:
                p.terminate()
                unfinished.append(s.name)
            for p, _ in running:
                p.wait(timeout=30)
            unfinished = [n for n in unfinished if not (out_dir / n / "summary.json").is_file()]
            break
        time.sleep(1.0)
        running = [(p, s) for p, s in running if p.poll() is None]
    return unfinished


def main(argv: list[str]) -> None:
    """CLI: `run --plan P --out DIR [--jobs J --device D --deadline-s S]`, `report DIR [DIR…] [--include
    SUMMARY.json …]`, `one SPEC PLAN DIR DEV`."""
    ap, _, rep = plan_parser("python -m experiments.zocurv_fair.fair", PLANS, device=("device", "cuda", None),
                             deadline_s=400.0, one=("spec", "plan", "out", "device"))
    rep.add_argument("--include", type=Path, action="append", default=[],
                     help="an earlier fair_summary.json whose runs join the report (repeatable)")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        left = run_plan(a.plan, a.out, jobs=a.jobs, device=a.device, deadline_s=a.deadline_s)
        print(json.dumps({"unfinished": left}))
    elif a.cmd == "report":
        s = report(a.out, a.more, a.include)
        print(json.dumps({k: v for k, v in s.items() if k not in ("runs", "partial_runs")}, indent=1))
    else:
        run_one(FairRun(**json.loads(a.spec)), PLANS[a.plan][1], a.device, Path(a.out))


if __name__ == "__main__":
    main(sys.argv[1:])
