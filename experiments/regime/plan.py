"""Issue 29's fair comparison at the large-batch regime, as a resumable, adaptive benchmark plan.

Protocol (issue 29, "A fair comparison"; the issue-17 rules of experiments.zocurv_fair.fair otherwise): every run is
a full schedule of its own length T — linear warmup 10% of T, then cosine to 0.1×peak or linear to zero
(`schedule`), β = (0.9, 0.95), weight decay 0.1 on matrices, clip 1.0 — scored by its validation loss at the
end of its own schedule. Stages (`next_runs`, recomputed after every finished run, so a plan resumes from
whatever finished in earlier calls; runs with a summary.json are never rerun):
1. bracket: AdamW at T_ref for every (lr, schedule) of the plan, seed 0; when the best lr sits at an edge of
   the bracket, one more lr beyond it (×2 or ÷2) until it is bracketed on both sides.
2. AdamW seeds 1..n−1 at the best (lr, schedule) (n = `adamw_seeds`, 3): the target = their mean at T_ref.
   Each arm (static table, trust region from the table and from 1, zocurv-global, ...) at T_ref, seed 0, at
   the best AdamW lr and schedule (`arm_lr` fixes the arms' lr instead, so a short call starts them at once).
3. each arm at the next shorter T of `fracs`·T_ref while its previous T reached the target (mean over seeds);
4. a second seed for an arm at every T it reached below T_ref (its ratio is below 1 there).
Ratio (experiments.regime.score) = smallest T whose full schedule reaches AdamW(T_ref)'s n-seed mean, ÷ T_ref.

Plans (`PLANS`): "full" is issue 29's (gpt2-small, 64×1024 tokens per step, T_ref 400, AdamW lr 3e-4…2.4e-3
× both schedules); "h200" the reduced one-call plan (32×512 on classics-large, T_ref 200, 2 lrs, static and trust-region arms,
arms started with AdamW at a fixed lr: experiments/regime/run.sh) and its follow-up calls "h200b" (adaptive: bracket closed,
arms at the best lr, shorter T), "h200c" and "h200d" (explicit runs around what the earlier calls found; the
2026-12-02 result in experiments/regime/results/); "cpu" a tiny dry run. `--batch-size`/`--seq-len`/`--corpus`
override a plan's settings (the same command at another regime), `--devices cuda:0,…,cuda:7` spreads runs
over GPUs round-robin (one process per run), `--micro-batch-size M` accumulates each step's gradients over
batch/M forward/backward passes: 0.5M tokens per step per GPU is `--plan full --batch-size 512 --seq-len 1024
--micro-batch-size 32 --devices cuda:0,…,cuda:7 --jobs 8` (8 runs at a time, one per GPU).

Usage: `python -m experiments.regime run --plan h200 --out DIR --jobs 4 --deadline-s 440`, then
`python -m experiments.regime report DIR` (table, JSON, PNG; experiments.regime.score).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from experiments.run_spec import CHECKOUT, OptionsRun, train_into

ADAMW = "adamw"


@dataclass(frozen=True)
class RegimeRun(OptionsRun):
    """One full-schedule run (name = its folder)."""

    optimizer: str
    lr: float
    steps: int
    schedule: str = "cosine"
    seed: int = 0
    warmup_frac: float = 0.1
    plan: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.optimizer}-lr{self.lr:g}-{self.schedule}-T{self.steps}-s{self.seed}{self.options_suffix}"

    @property
    def arm(self) -> str:
        """The arm this run belongs to: optimizer plus options (lr and schedule are the comparison's)."""
        return self.optimizer + "".join(f"[{k}={v}]" for k, v in self.options)


@dataclass(frozen=True)
class Plan:
    """A comparison plan: run settings (trainer.config.TrainConfig fields), AdamW bracket, arms, T grid."""

    settings: dict[str, Any]
    t_ref: int
    adamw_lrs: tuple[float, ...]
    schedules: tuple[str, ...] = ("cosine", "linear")
    arms: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    fracs: tuple[float, ...] = (0.875, 0.75, 0.625, 0.5)
    adamw_seeds: int = 3
    arm_lr: float | None = None  # None: the best AdamW lr (stage 2); a number: start the arms at once
    arm_schedule: str | None = None
    adaptive: bool = True  # False: only the runs of stages 1-2 (a one-call plan)
    extra: tuple[RegimeRun, ...] = field(default_factory=tuple)


ARMS = (("zocurv-static", ()), ("zocurv-trust", (("start", "table"),)), ("zocurv-trust", (("start", "one"),)),
        ("zocurv-global", ()))
FULL = Plan({"model": "gpt2-small", "corpus": "classics-large", "batch_size": 64, "seq_len": 1024,
             "eval_batches": 16, "curvature_interval": 25, "probe_batch_size": 16},
            t_ref=400, adamw_lrs=(3e-4, 6e-4, 1.2e-3, 2.4e-3), arms=ARMS)
H200 = Plan({"model": "gpt2-small", "corpus": "classics-large", "batch_size": 32, "seq_len": 512, "eval_batches": 16,
             "curvature_interval": 25, "probe_batch_size": 8},
            t_ref=200, adamw_lrs=(6e-4, 1.2e-3), schedules=("cosine",), arms=ARMS[:3], adamw_seeds=1,
            arm_lr=1.2e-3, arm_schedule="cosine", adaptive=False,
            extra=(RegimeRun(ADAMW, 1.2e-3, 200, "linear"), RegimeRun("zocurv-static", 6e-4, 200),
                   RegimeRun("zocurv-trust", 1.2e-3, 150, options=(("start", "table"),))))
# "h200b": the second call of the one-GPU plan, resuming from the first call's run folders (same settings): adaptive,
# the arms at the best AdamW lr and at shorter T while they reach AdamW(T_ref), the first call's lr-1.2e-3 runs first.
H200B = replace(H200, arms=ARMS[:2], arm_lr=None, arm_schedule=None, adaptive=True, fracs=(0.75, 0.5),
                extra=(RegimeRun(ADAMW, 1.2e-3, 200, "linear"), RegimeRun("zocurv-static", 1.2e-3, 200),
                       RegimeRun("zocurv-trust", 1.2e-3, 200, options=(("start", "one"),))))
# "h200c": the third call: 3 seeds at the best AdamW lr (3e-4, found by h200b) and explicit arm runs around what
# h200b found (the arms at 3e-4 and 6e-4, shorter T, a second seed, zocurv-global), in priority order.
_S, _TR, _T1 = "zocurv-static", (("start", "table"),), (("start", "one"),)
H200C = replace(H200, arms=(), adamw_seeds=3, arm_lr=3e-4, adaptive=False, extra=(
    RegimeRun(_S, 6e-4, 150), RegimeRun("zocurv-trust", 6e-4, 200, options=_TR),
    RegimeRun("zocurv-global", 3e-4, 200), RegimeRun(_S, 6e-4, 175), RegimeRun("zocurv-trust", 3e-4, 175, options=_TR),
    RegimeRun("zocurv-trust", 6e-4, 150, options=_TR), RegimeRun(ADAMW, 3e-4, 200, "linear"),
    RegimeRun("zocurv-trust", 3e-4, 200, options=_T1), RegimeRun(_S, 6e-4, 200, seed=1),
    RegimeRun("zocurv-trust", 3e-4, 200, seed=1, options=_TR)))
# "h200d": the fourth call, one wave: second seeds at the shortest T that reached the target, the trust region at 6e-4.
H200D = replace(H200C, extra=(
    RegimeRun(_S, 6e-4, 175, seed=1), RegimeRun("zocurv-trust", 3e-4, 175, seed=1, options=_TR),
    RegimeRun("zocurv-trust", 6e-4, 175, options=_TR), RegimeRun("zocurv-trust", 6e-4, 200, options=_T1)))
CPU = Plan({"model": "gpt2-tiny", "corpus": "classics-small", "batch_size": 2, "seq_len": 16, "eval_batches": 2,
            "curvature_interval": 2, "probe_batch_size": 2},
           t_ref=4, adamw_lrs=(3e-3, 1e-2), arms=ARMS, fracs=(0.75, 0.5), adamw_seeds=2)
PLANS = {"full": FULL, "h200": H200, "h200b": H200B, "h200c": H200C, "h200d": H200D, "cpu": CPU}


# ---- the adaptive plan (pure) --------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def best_adamw(plan: Plan, done: dict[str, float]) -> tuple[float, str] | None:
    """(lr, schedule) of the best AdamW seed-0 run at T_ref among `done` ({run name: final val loss}); None
    before every bracket run of the plan finished."""
    lrs = bracket_lrs(plan, done)
    grid = [RegimeRun(ADAMW, lr, plan.t_ref, s) for lr in lrs for s in plan.schedules]
    if any(r.name not in done for r in grid):
        return None
    best = min(grid, key=lambda r: done[r.name])
    return best.lr, best.schedule


def bracket_lrs(plan: Plan, done: dict[str, float]) -> list[float]:
    """The plan's lrs plus ×2 / ÷2 steps beyond an edge that was best (at most 3 extensions each way)."""
    lrs = sorted(plan.adamw_lrs)
    for _ in range(6):
        finals = {lr: min((done[n] for s in plan.schedules
                           if (n := RegimeRun(ADAMW, lr, plan.t_ref, s).name) in done), default=None) for lr in lrs}
        if any(v is None for v in finals.values()):
            return lrs
        best = min(lrs, key=lambda lr: finals[lr])
        if best == lrs[0] and len(lrs) < len(plan.adamw_lrs) + 3:
            lrs.insert(0, best / 2)
        elif best == lrs[-1] and len(lrs) < len(plan.adamw_lrs) + 3:
            lrs.append(best * 2)
        else:
            return lrs
    return lrs


def next_runs(plan: Plan, done: dict[str, float]) -> list[RegimeRun]:
    """Every run the plan wants given the finished ones (`done`: {run name: final val loss}), finished ones
    included, in priority order (module docstring). Pure."""
    runs = [RegimeRun(ADAMW, lr, plan.t_ref, s) for lr in bracket_lrs(plan, done) for s in plan.schedules]
    best = best_adamw(plan, done)
    if plan.arm_lr is not None:
        arm_lr, arm_sched = plan.arm_lr, plan.arm_schedule or plan.schedules[0]
    elif best is not None:
        arm_lr, arm_sched = best
    else:
        return runs + list(plan.extra)
    if best is not None:
        runs += [RegimeRun(ADAMW, best[0], plan.t_ref, best[1], seed=s) for s in range(1, plan.adamw_seeds)]
    arms = [RegimeRun(o, arm_lr, plan.t_ref, arm_sched, options=opts) for o, opts in plan.arms]
    runs += arms + list(plan.extra)
    target = _target(plan, best, done)
    if not plan.adaptive or target is None:
        return runs
    for arm in arms:
        reached_prev = True
        for frac in (1.0, *plan.fracs):
            t = round(frac * plan.t_ref)
            at_t = [replace(arm, steps=t, seed=s) for s in (0, 1)]
            if not reached_prev:
                break
            if frac != 1.0:
                runs.append(at_t[0])
            finals = [done[r.name] for r in at_t if r.name in done]
            if not finals:
                break
            reached_prev = _mean(finals) <= target
            if reached_prev and frac != 1.0:
                runs.append(at_t[1])  # ratio below 1 here: a second seed
    return list(dict.fromkeys(runs))


def _target(plan: Plan, best: tuple[float, str] | None, done: dict[str, float]) -> float | None:
    if best is None:
        return None
    seeds = [RegimeRun(ADAMW, best[0], plan.t_ref, best[1], seed=s).name for s in range(plan.adamw_seeds)]
    return _mean([done[n] for n in seeds]) if all(n in done for n in seeds) else None


# ---- running -----------------------------------------------------------------------------------------------
def run_config(spec: RegimeRun, settings: dict[str, Any], device: str, run_dir: Path):
    """The TrainConfig of `spec` under the protocol (module docstring); evaluation at T/2 and T."""
    from trainer.config import TrainConfig

    return TrainConfig(**settings, optimizer=spec.optimizer, steps=spec.steps, lr=spec.lr, min_lr=0.1 * spec.lr,
                       schedule=spec.schedule, warmup_steps=max(1, round(spec.warmup_frac * spec.steps)),
                       weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=max(1, spec.steps // 2),
                       checkpoint_every=10 * spec.steps, seed=spec.seed, device=device, run_dir=run_dir,
                       optimizer_options=dict(spec.options))


def run_one(spec: RegimeRun, settings: dict[str, Any], device: str, out_dir: Path) -> None:
    """Train one spec into out_dir/spec.name (experiments.run_spec.train_into); settings["micro_batch_size"], when
    given, accumulates each step's gradients over micro-batches of that many sequences."""
    settings = dict(settings)
    micro = settings.pop("micro_batch_size", None)
    train_into(spec, out_dir, lambda run_dir: run_config(spec, settings, device, run_dir), micro_batch_size=micro)


def finished(out_dir: Path) -> dict[str, float]:
    """{run name: final val loss} of the finished runs (summary.json present) under out_dir."""
    done = {}
    for d in out_dir.iterdir() if out_dir.is_dir() else ():
        if (d / "summary.json").is_file() and (d / "metrics.jsonl").is_file():
            vals = [json.loads(x)["val_loss"] for x in (d / "metrics.jsonl").read_text().splitlines()
                    if '"val_loss"' in x]
            if vals:
                done[d.name] = float(vals[-1])
    return done


def run_plan(plan_name: str, out_dir: Path, *, jobs: int, devices: list[str], deadline_s: float,
             settings: dict[str, Any]) -> list[str]:
    """Run what `next_runs` wants, `jobs` processes at a time over `devices` (round-robin), re-planning after
    every finished run; past the deadline stop the rest. Returns the names of runs started but unfinished."""
    plan = PLANS[plan_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + deadline_s
    running: dict[str, subprocess.Popen] = {}
    failed: set[str] = set()
    started = 0
    while True:
        done = finished(out_dir)
        for n, p in list(running.items()):
            if p.poll() is not None and n not in done:
                failed.add(n)  # exited without a summary: not started again (its log says why)
        running = {n: p for n, p in running.items() if p.poll() is None}
        pending = [r for r in next_runs(plan, done)
                   if r.name not in done and r.name not in running and r.name not in failed]
        if (not pending and not running) or time.monotonic() >= t_end:
            break
        while pending and len(running) < jobs:
            spec = replace(pending.pop(0), plan=plan_name)
            dev = devices[started % len(devices)]
            started += 1
            log = (out_dir / f"{spec.name}.log").open("w")
            cmd = [sys.executable, "-m", "experiments.regime.plan", "one", json.dumps(asdict(spec)),
                   json.dumps(settings), str(out_dir), dev]
            running[spec.name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=CHECKOUT)
        time.sleep(1.0)
    for p in running.values():
        p.terminate()  # train() checkpoints between steps on SIGTERM; a step or refresh may take a while
    for p in running.values():
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for n in sorted(failed):
        print(f"{n}: exited without finishing; see {out_dir / (n + '.log')}", file=sys.stderr)
    return [n for n in [*running, *sorted(failed)] if n not in finished(out_dir)]


def main(argv: list[str]) -> None:
    """`one SPEC SETTINGS DIR DEV`: one run (what run_plan starts per run, SPEC and SETTINGS as JSON). The plan itself
    is `python -m experiments.regime` (`run --plan P --out DIR [...]`, `report DIR [DIR...]`): not imported here, as
    experiments.regime.cli imports this module's PLANS. Exit 2 for anything else."""
    if argv[:1] == ["one"] and len(argv) == 5:
        spec, settings, out, device = argv[1:]
        run_one(RegimeRun(**json.loads(spec)), json.loads(settings), device, Path(out))
        return
    print("usage: python -m experiments.regime.plan one SPEC SETTINGS DIR DEV; the plan: "
          "`python -m experiments.regime run|report`", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
