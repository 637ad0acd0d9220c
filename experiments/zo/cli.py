"""`python -m experiments.zo`: the ZO side-by-side benchmarks (experiments.zo.bench; `--regime paper`:
experiments.zo_paper.paper). Its options are generated from ZoBenchOptions by trainer.cli_settings, as the product's
commands' are. Run from the repository root (experiments/ is not installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import typer
from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.options import parse
from trainer.cli_settings import SettingsCommand, with_settings

SECTION = "Options"


class ZoBenchOptions(BaseModel):
    """`python -m experiments.zo`: the ZO side-by-side benchmarks (experiments.zo.bench; --regime paper: experiments.zo_paper.paper)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    part: Literal["lm", "sentiment", "all"] = Field(
        "all", description="lm (gpt2-tiny: AdamW vs ZO-Curv), sentiment (MeZO/1SPSA/1.5-SPSA) or all")
    out: Path = Field(Path("runs/zo-bench"), description="Folder for JSON summaries, PNG figures and run folders")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    steps: int = Field(600, ge=1, description="lm: optimizer steps per run")
    probes: int = Field(32, ge=1, description="lm: block-scaled probes per curvature round")
    k: int = Field(16, ge=1, description="sentiment: probes K per step of 1SPSA and 1.5-SPSA")
    budget: int = Field(6000, ge=3, description="sentiment: forward passes per run")
    lrs: str = Field("1e-5,1e-4,1e-3", description="sentiment: comma-separated learning rates tried per method")
    seed: int = Field(0, ge=0, description="Run seed")
    methods: str = Field("mezo,1spsa,1.5spsa", description="sentiment: comma-separated ZO methods to sweep")
    model: Literal["minilm", "smollm2"] = Field(
        "minilm", description="sentiment: minilm (MiniLM-L6 + new head) or smollm2 (SmolLM2-135M-Instruct as a "
        "prompt + label-word classifier, all parameters)")
    head_init: str | None = Field(None, description="sentiment: classifier start; minilm: random (BERT init, default) "
                               "or linear-probe (logistic regression on frozen features first: LP-FT); smollm2: "
                               "prompt (the zero-shot prompt classifier, its only start)")
    evals: int = Field(10, ge=1, description="sentiment: accuracy evaluations per run")
    backprop_steps: int = Field(0, ge=0, description="sentiment: also run the backprop AdamW baseline this many steps")
    backprop_lr: float | None = Field(None, ge=0.0, description="sentiment: AdamW lr of the baseline (default 5e-5 "
                                   "minilm, 1e-5 smollm2)")
    regime: Literal["project", "paper"] = Field(
        "project", description="sentiment: project (the sweep above) or paper (smollm2 only: 1.5-SPSA's published "
        "regime, arms A1..A6 of issue 18; experiments.zo_paper.paper)")
    arms: str = Field("", description="regime paper: comma-separated arms (A1,A2,A3,A3w,A4-16,A4-128,A5-1e-05,"
                   "A5-3e-05,A6-1e-05,A6-5e-05); empty = all. The time budget is shared by these only")
    time_budget: float = Field(300.0, ge=1.0, description="regime paper: seconds shared by the arms run now (each "
                            "stops at its share or its iteration cap)")
    fp32_matmul: str = Field("highest", description="regime paper, CUDA: fp32 arms' matmuls, highest (true fp32) or "
                          "high (TF32: ~2x faster, but its rounding swamps h at eps 1e-4); per arm: e.g. "
                          "high,A1=highest,A3=highest (a bare mode is the default)")
    include: Path | None = Field(None, description="regime paper: an earlier call's paper_summary.json to merge: its "
                              "arms are kept unless re-run; its A1 gives A3w's lr and the drift's ledger")
    resume: bool = Field(False, description="regime paper: an arm named in --arms that stopped on time in the "
                      "--include summary continues from its last iteration (its step ledger replayed) instead of "
                      "restarting; one that finished there is kept")
    shares: str = Field("", description="regime paper: share weights overriding the defaults (A1 24, A2 16, A3 11, "
                     "A3w 11, A4-16 5, A4-128 8, A5-* 5, A6-* 3), e.g. A1=70,A3=24; renormalised")
    drift: bool = Field(True, description="regime paper: measure the bf16 in-place drift on A1's ledger (once per "
                     "ledger, after the arms; ~10 s on a GPU at 75 iterations)")
    iters_cap: int | None = Field(None, ge=1, description="regime paper: cap every arm's iterations (smoke tests)")
    end_by: float | None = Field(None, description="regime paper: wall-clock deadline (unix seconds, e.g. "
                              "$(( $(date +%s) + 540 ))): the arms' budget shrinks so the run ends by then")

    @model_validator(mode="after")
    def _paper_options(self) -> ZoBenchOptions:
        if self.regime == "paper" and self.model != "smollm2":
            raise ValueError(f"--model: --regime paper runs on smollm2 only, got {self.model!r}")
        if self.resume and self.include is None:
            raise ValueError("--resume continues arms of an --include summary: give --include")
        return self

    @property
    def arm_names(self) -> tuple[str, ...] | None:
        """--arms as a tuple (None: every arm)."""
        return tuple(a.strip() for a in self.arms.split(",") if a.strip()) or None


@with_settings(model=ZoBenchOptions, param="given", section=SECTION)
def bench_zo(given: dict) -> None:
    """Run the ZO benchmarks on real data and write lm_summary.json / sentiment_summary.json and PNGs."""
    from experiments.zo.bench import SentimentSpec, lm_comparison, sentiment_comparison

    o = parse(ZoBenchOptions, given)
    if o.regime == "paper":
        _bench_zo_paper(o)
        return
    # Every option is checked before anything runs: with --part all the lm part takes minutes first.
    ms, head_init, grid = _check_zo_project(o)
    if o.part in ("lm", "all"):
        s = lm_comparison(o.out, o.steps, o.device, o.probes, o.seed)
        typer.echo(json.dumps({k: {"final_val_loss": v["final_val_loss"], "steps_to_adamw_final":
                                   v["steps_to_adamw_final"]} for k, v in s["runs"].items()}))
    if o.part in ("sentiment", "all"):
        spec = SentimentSpec(model=o.model, head_init=head_init, budget=o.budget, probes=o.k, seed=o.seed,
                             device=o.device, evals=o.evals)
        s = sentiment_comparison(o.out, spec, grid, ms, o.backprop_steps, o.backprop_lr)
        typer.echo(json.dumps({m: {k2: v for k2, v in b.items() if k2 != "curve"} for m, b in s["best"].items()}))
        if "1.5spsa_vs_mezo" in s:
            typer.echo(json.dumps({"1.5spsa_vs_mezo": s["1.5spsa_vs_mezo"]}))


def _check_zo_project(o: ZoBenchOptions) -> tuple[tuple[str, ...], str | None, tuple[float, ...]]:
    """`--regime project`'s options checked before anything runs; returns (methods, the resolved
    head init, the lr grid). Raises typer.BadParameter naming the option at fault."""
    from experiments.zo.bench import check_sentiment_folder, forwards_per_step, resolve_head_init
    from trainer.methods import method_names

    part, out, device, methods, model, lrs, budget, k = o.part, o.out, o.device, o.methods, o.model, o.lrs, o.budget, o.k
    ms = tuple(m.strip() for m in methods.split(",") if m.strip())
    pure_zo = method_names(kind="pure-zo", task="sentiment")
    bad = [m for m in ms if m not in pure_zo]
    if bad or not ms:
        raise typer.BadParameter(f"methods are {', '.join(pure_zo)}; got {methods!r}", param_hint="--methods")
    try:
        head_init = resolve_head_init(model, o.head_init)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--head-init") from None
    try:  # empty is allowed: experiments/headline/run.sh merges earlier runs' JSON with --lrs ""
        grid = tuple(float(x) for x in lrs.split(",") if x.strip())
    except ValueError:
        grid = (float("nan"),)
    if not all(0 < lr < 1 for lr in grid):
        raise typer.BadParameter(f"comma-separated learning rates in (0, 1), got {lrs!r}", param_hint="--lrs")
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise typer.BadParameter(f"cpu or cuda[:N], got {device!r}", param_hint="--device") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise typer.BadParameter(f"{device!r} is not available here (CUDA available: "
                                 f"{torch.cuda.is_available()})", param_hint="--device")
    if part in ("sentiment", "all") and grid:
        # forward passes per step: 2 per probe (+1 clean for 1.5-SPSA); a smaller budget would run no step
        need = {m: forwards_per_step(m, k) for m in ms}
        short = {m: n for m, n in need.items() if budget < n}
        if short:
            raise typer.BadParameter(f"{budget} forward passes is less than one step of {short} (forwards per "
                                     f"step with --k {k}); raise --budget", param_hint="--budget")
    if part in ("sentiment", "all"):
        try:
            check_sentiment_folder(out, model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None
    return ms, head_init, grid


def _bench_zo_paper(o: ZoBenchOptions) -> None:
    """`python -m experiments.zo --regime paper`: validate, run experiments.zo_paper.paper.paper_main, print the arms' table."""
    from experiments.zo_paper.paper import PaperCall, paper_main
    from experiments.zo_paper.plan import check_plan, paper_arms, parse_matmul, parse_weights

    time_budget, names, include = o.time_budget, o.arm_names, o.include
    try:
        weights = parse_weights(o.shares)
        paper_arms(time_budget, weights=weights)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--shares") from None
    try:
        plan = [a["name"] for a in paper_arms(time_budget, names)]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    inc = None
    if include is not None:
        try:
            inc = json.loads(include.read_text())
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"cannot read {include}: {e}", param_hint="--include") from None
    try:
        check_plan(plan, inc)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    try:
        matmul = parse_matmul(o.fp32_matmul, plan)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--fp32-matmul") from None
    import torch

    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{o.device!r} is not available here", param_hint="--device")
    call = PaperCall(total_s=time_budget, arms=names, seed=o.seed, resume=o.resume, matmul=matmul,
                     weights=weights or None, drift=o.drift, iters_cap=o.iters_cap, end_by=o.end_by)
    s = paper_main(o.out, call, device=o.device, include=include)
    for row in s["table"]:
        typer.echo(json.dumps(row))
    if "drift" in s:
        typer.echo(json.dumps({"drift": s["drift"]}))


app = typer.Typer(help="ZO-Curv and pure-ZO benchmarks on real data.", add_completion=False)
app.command(cls=SettingsCommand)(bench_zo)

if __name__ == "__main__":
    app(prog_name="python -m experiments.zo")
