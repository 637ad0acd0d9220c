"""Headline benchmarks (issue "Headline benchmarks on the H200"): the pieces `python -m experiments.headline` runs.

- `pretrain_report(run_dirs, out_dir)`: reads finished `sparecycles train` run folders (AdamW at one or more
  learning rates, ZO-Curv variants) and writes `pretrain_summary.json` plus `pretrain_val_loss.png`: the
  validation loss at equal steps, and the steps and trainer wall time each run needs to reach the final
  validation loss of each AdamW reference (same lr, best lr).
- `memory_scan(device, sizes)`: the largest GPT shape that takes a training step in place on one GPU with
  AdamW (fp32 weights + gradients + two moments) and with 1.5-SPSA (fp32 weights only, updated in place by
  seed replay), with the peak memory of each step.
The runs themselves are ordinary `sparecycles train` invocations (experiments/headline/run.sh).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

# GPT shapes past the GPT-2 presets for the memory scan: (n_layer, n_head, n_embd), the GPT-3 paper's
# table 2.1 widths (Brown et al. 2020) with GPT-2's vocabulary and a 1024-token context.
SCAN_SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt2-xl": (48, 25, 1600),
    "gpt-2.7b": (32, 32, 2560),
    "gpt-6.7b": (32, 32, 4096),
    "gpt-13b": (40, 40, 5120),
    "gpt-30b": (48, 56, 7168),
    "gpt-45b": (56, 64, 8192),  # past one H200's memory even as fp32 weights alone (180 GB)
}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(run_dir: Path) -> dict[str, Any]:
    """One finished run folder -> {name, optimizer, lr, steps, val: [(step, val_loss)], elapsed: {step: s}}.

    `elapsed` is the trainer's wall time (seconds since its first step) logged at each step. Raises
    FileNotFoundError if config.json or metrics.jsonl is missing, ValueError if the run has no evaluation.
    """
    cfg = json.loads((run_dir / "config.json").read_text())
    recs = _read_jsonl(run_dir / "metrics.jsonl")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if not val:
        raise ValueError(f"{run_dir} holds no validation record")
    elapsed = {r["step"]: r["elapsed_s"] for r in recs if "elapsed_s" in r}
    fwd = {r["step"]: r["forward_passes"] for r in recs if "forward_passes" in r}
    return {"name": run_dir.name, "optimizer": cfg["optimizer"], "lr": cfg["lr"], "steps": max(elapsed or {0: 0}),
            "model": cfg["model"], "corpus": cfg["corpus"], "val": val, "elapsed": elapsed, "forward_passes": fwd}


def first_reach(val: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated step whose validation loss is <= target (None if never). Pure."""
    return next((s for s, v in val if v <= target), None)


def pretrain_report(run_dirs: list[Path], out_dir: Path) -> dict[str, Any]:
    """Compare finished runs; write pretrain_summary.json and pretrain_val_loss.png into out_dir.

    For each run and each AdamW reference (the AdamW run at the same lr, and the AdamW run with the lowest
    final validation loss): the step at which the run first reaches the reference's final validation loss
    and the ratio to the reference's steps, and the same in trainer wall time (seconds; a ZO-Curv run's
    time includes its probe rounds when they ran on the same GPU). Raises ValueError without an AdamW run.
    """
    runs = [load_run(Path(d)) for d in run_dirs]
    adamw = [r for r in runs if r["optimizer"] == "adamw"]
    if not adamw:
        raise ValueError("the report needs at least one AdamW run as the reference")
    best = min(adamw, key=lambda r: r["val"][-1][1])
    out: dict[str, Any] = {"best_adamw": best["name"], "runs": {}}
    for r in runs:
        refs = {"best_adamw": best}
        same = [a for a in adamw if a["lr"] == r["lr"]]
        if same:
            refs["same_lr_adamw"] = same[0]
        entry: dict[str, Any] = {"optimizer": r["optimizer"], "lr": r["lr"], "steps": r["steps"],
                                 "final_val_loss": r["val"][-1][1], "wall_s": r["elapsed"].get(r["steps"]),
                                 "forward_passes": r["forward_passes"].get(r["steps"]), "val_curve": r["val"],
                                 "wall_at_eval": [r["elapsed"].get(st) for st, _ in r["val"]]}
        for key, ref in refs.items():
            target = ref["val"][-1][1]
            hit = first_reach(r["val"], target)
            ref_wall = ref["elapsed"].get(ref["steps"])
            wall = r["elapsed"].get(hit) if hit is not None else None
            entry[key] = {"reference": ref["name"], "target_val_loss": target, "step_reached": hit,
                          "step_ratio": hit / ref["steps"] if hit is not None else None,
                          "wall_s_reached": wall,
                          "wall_ratio": wall / ref_wall if wall is not None and ref_wall else None}
        out["runs"][r["name"]] = entry
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pretrain_summary.json").write_text(json.dumps(out, indent=2))
    _plot(runs, out_dir / "pretrain_val_loss.png")
    return out


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        label = f"{r['optimizer']} (lr {r['lr']:g})"
        s, v = zip(*r["val"])
        a1.plot(s, v, marker=".", label=label)
        t = [r["elapsed"].get(x, 0.0) for x in s]
        a2.plot(t, v, marker=".", label=label)
    m = runs[0]
    for ax, xl in ((a1, "optimizer step"), (a2, "trainer wall time (s)")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        lo = min(v for r in runs for _, v in r["val"])
        ax.set_ylim(lo - 0.1, lo + 2.5)  # the first evaluations (~10.8 nats) would flatten the curves
    fig.suptitle(f"{m['model']} on {m['corpus']}: AdamW vs ZO-Curv")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _build_shape(n_layer: int, n_head: int, n_embd: int, dtype: torch.dtype, device: str, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(dtype)
    model.loss_type = "ForCausalLM"
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)  # random init is enough to measure memory
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model


def _step_peak(name: str, method: str, device: str, batch: int, seq_len: int) -> dict[str, Any]:
    """Peak bytes of building `name` and taking two steps of `method` at (batch, seq_len) tokens."""
    from trainer.models.gpt2 import GPT2Preset
    from trainer.models.losses import lm_batch_loss
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.zo_step import ZOStepper

    n_layer, n_head, n_embd = SCAN_SHAPES[name]
    n = GPT2Preset(name, n_layer=n_layer, n_head=n_head, n_embd=n_embd).num_params()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = opt = None
    t0 = time.perf_counter()
    try:
        model = _build_shape(*SCAN_SHAPES[name], torch.float32, device, seed=0)
        x = torch.randint(0, 50257, (batch, seq_len), device=device)
        if method == "adamw":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                lm_batch_loss(model, (x, x)).backward()
                opt.step()
        else:
            stepper = ZOStepper(model, "1.5spsa", run_seed=0, probes=2)
            backend = InProcessBackend(model, lm_batch_loss)
            for s in range(2):
                stepper.step(s, (x, x), backend, 1e-6)
        torch.cuda.synchronize(device)
        ok, err = True, None
    except torch.OutOfMemoryError as exc:
        ok, err = False, str(exc).splitlines()[0][:160]
    peak = torch.cuda.max_memory_allocated(device)
    del model, opt
    torch.cuda.empty_cache()
    return {"shape": name, "method": method, "ok": ok, "params": n, "peak_bytes": peak,
            "seconds": time.perf_counter() - t0, "error": err}


def memory_scan(device: str = "cuda", sizes: tuple[str, ...] = tuple(SCAN_SHAPES), batch: int = 1,
                seq_len: int = 1024) -> dict[str, Any]:
    """For AdamW and 1.5-SPSA, try each shape in increasing size until one runs out of memory.

    Returns {"gpu", "gpu_bytes", "batch", "seq_len", "trials": [...], "largest": {method: shape}} where each
    trial holds params, peak bytes (torch.cuda.max_memory_allocated) and ok/error. Both methods keep fp32
    weights; AdamW adds fp32 gradients and two fp32 moments (fused step), 1.5-SPSA (K=2 probes) adds one
    parameter's scratch for the perturbed copy (probe_kernels.evaluator) and no gradients. Raises RuntimeError
    without CUDA, ValueError for an unknown shape.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the memory scan needs a CUDA GPU")
    unknown = [s for s in sizes if s not in SCAN_SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; choose from {sorted(SCAN_SHAPES)}")
    torch.set_float32_matmul_precision("high")
    torch.zeros(1, device=device)  # create the context first: the peak-memory counters need it
    trials, largest = [], {}
    for method in ("adamw", "1.5spsa"):
        for name in sizes:
            t = _step_peak(name, method, device, batch, seq_len)
            trials.append(t)
            print(json.dumps(t), flush=True)
            if not t["ok"]:
                break
            largest[method] = name
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "gpu_bytes": props.total_memory, "batch": batch, "seq_len": seq_len,
            "trials": trials, "largest": largest}
