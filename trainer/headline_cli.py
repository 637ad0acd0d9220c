"""`sparecycles bench headline`: the headline benchmarks' report and memory scan (typer + stdlib at import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

headline_app = typer.Typer(help="Headline benchmarks: pretraining report, memory scan (tools/h200_headline.sh "
                                "runs the whole set on a GPU machine).", no_args_is_help=True)


@headline_app.command("report")
def report(
    runs: Annotated[list[Path], typer.Argument(help="finished `sparecycles train` run folders (one AdamW at least)")],
    out: Annotated[Path, typer.Option(help="folder for pretrain_summary.json and pretrain_val_loss.png")] = Path(
        "runs/headline"),
) -> None:
    """Validation loss at equal steps, and steps / wall time to reach each AdamW reference's final loss."""
    from trainer.headline import pretrain_report

    missing = [str(r) for r in runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        raise typer.BadParameter(f"not run folders (no metrics.jsonl): {', '.join(missing)}")
    try:
        res = pretrain_report(runs, out)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    for name, r in res["runs"].items():
        same = r.get("same_lr_adamw", {})
        typer.echo(f"{name}: final val {r['final_val_loss']:.4f}; reaches best AdamW final at step "
                   f"{r['best_adamw']['step_reached']} (ratio {r['best_adamw']['step_ratio']}); same-lr AdamW "
                   f"final at step {same.get('step_reached')} (ratio {same.get('step_ratio')})")
    typer.echo(f"wrote {out / 'pretrain_summary.json'} and {out / 'pretrain_val_loss.png'}")


@headline_app.command("memory")
def memory(
    device: Annotated[str, typer.Option(help="CUDA device")] = "cuda",
    shapes: Annotated[str, typer.Option(help="comma-separated shapes, ascending (trainer.headline.SCAN_SHAPES)")] = (
        "gpt2-xl,gpt-2.7b,gpt-6.7b,gpt-13b,gpt-30b,gpt-45b"),
    seq_len: Annotated[int, typer.Option(min=1, max=1024, help="tokens per sequence (batch 1)")] = 1024,
    json_out: Annotated[Path | None, typer.Option(help="write the scan as JSON here")] = None,
) -> None:
    """Largest GPT shape that takes a training step in place with AdamW vs 1.5-SPSA on one GPU; peak memory."""
    from trainer.headline import memory_scan

    try:
        res = memory_scan(device, tuple(s.strip() for s in shapes.split(",") if s.strip()), seq_len=seq_len)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    for t in res["trials"]:
        typer.echo(f"{t['method']:8s} {t['shape']:9s} {t['params'] / 1e9:6.2f}B params  "
                   f"{'ok ' if t['ok'] else 'OOM'} peak {t['peak_bytes'] / 2**30:7.1f} GiB")
    typer.echo(f"largest: {res['largest']} on {res['gpu']} ({res['gpu_bytes'] / 2**30:.0f} GiB)")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    headline_app()
