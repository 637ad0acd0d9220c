"""`sparecycles bench zo`: the ZO side-by-side benchmarks (typer + stdlib at import; torch inside the body)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def bench_zo(
    part: str = typer.Option("all", help="lm (gpt2-tiny: AdamW vs ZO-Curv), sentiment (MeZO/1SPSA/1.5-SPSA) or all."),
    out: Path = typer.Option(Path("runs/zo-bench"), help="Folder for JSON summaries, PNG figures and run folders."),
    device: str = typer.Option("cpu", help="cpu or cuda[:N]."),
    steps: int = typer.Option(600, min=1, help="lm: optimizer steps per run."),
    probes: int = typer.Option(32, min=1, help="lm: block-scaled probes per curvature round."),
    k: int = typer.Option(16, min=1, help="sentiment: probes K per step of 1SPSA and 1.5-SPSA."),
    budget: int = typer.Option(6000, min=3, help="sentiment: forward passes per run."),
    lrs: str = typer.Option("1e-5,1e-4,1e-3", help="sentiment: comma-separated learning rates tried per method."),
    seed: int = typer.Option(0, min=0, help="Run seed."),
    methods: str = typer.Option("mezo,1spsa,1.5spsa", help="sentiment: comma-separated ZO methods to sweep."),
    model: str = typer.Option("minilm", help="sentiment: minilm (MiniLM-L6 + new head) or smollm2 "
                              "(SmolLM2-135M-Instruct as a prompt + label-word classifier, all parameters)."),
    head_init: str | None = typer.Option(None, help="sentiment: classifier start; minilm: random (BERT init, default) or "
                                  "linear-probe (logistic regression on frozen features first: LP-FT); smollm2: "
                                  "prompt (the zero-shot prompt classifier, its only start)."),
    evals: int = typer.Option(10, min=1, help="sentiment: accuracy evaluations per run."),
    backprop_steps: int = typer.Option(0, min=0, help="sentiment: also run the backprop AdamW baseline this many steps."),
    backprop_lr: float | None = typer.Option(None, min=0.0, help="sentiment: AdamW lr of the baseline (default 5e-5 minilm, "
                                      "1e-5 smollm2)."),
) -> None:
    """Run the ZO benchmarks on real data and write lm_summary.json / sentiment_summary.json and PNGs."""
    from trainer.zo.bench import (
        check_sentiment_folder,
        forwards_per_step,
        lm_comparison,
        resolve_head_init,
        sentiment_comparison,
    )

    if part not in ("lm", "sentiment", "all"):
        raise typer.BadParameter(f"part must be lm, sentiment or all, got {part!r}")
    # Every option is checked before anything runs: with --part all the lm part takes minutes first.
    ms = tuple(m.strip() for m in methods.split(",") if m.strip())
    bad = [m for m in ms if m not in ("mezo", "1spsa", "1.5spsa")]
    if bad or not ms:
        raise typer.BadParameter(f"methods are mezo, 1spsa, 1.5spsa; got {methods!r}", param_hint="--methods")
    if model not in ("minilm", "smollm2"):
        raise typer.BadParameter(f"minilm or smollm2, got {model!r}", param_hint="--model")
    try:
        head_init = resolve_head_init(model, head_init)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--head-init") from None
    try:  # empty is allowed: tools/h200_headline.sh merges earlier runs' JSON with --lrs ""
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
    if part in ("lm", "all"):
        s = lm_comparison(out, steps=steps, device=device, probes=probes, seed=seed)
        typer.echo(json.dumps({k: {"final_val_loss": v["final_val_loss"], "steps_to_adamw_final":
                                   v["steps_to_adamw_final"]} for k, v in s["runs"].items()}))
    if part in ("sentiment", "all"):
        s = sentiment_comparison(out, budget=budget, device=device, probes=k, lrs=grid, seed=seed, methods=ms,
                                 head_init=head_init, evals=evals, backprop_steps=backprop_steps, model=model,
                                 backprop_lr=backprop_lr)
        typer.echo(json.dumps({m: {k2: v for k2, v in b.items() if k2 != "curve"} for m, b in s["best"].items()}))
        if "1.5spsa_vs_mezo" in s:
            typer.echo(json.dumps({"1.5spsa_vs_mezo": s["1.5spsa_vs_mezo"]}))


if __name__ == "__main__":
    typer.run(bench_zo)
