"""Side measurements of the paper comparison (experiments.zo_paper.paper), each a device call of its own or a CPU
check: the largest GPT whose bf16 weights take in-place 1.5-SPSA steps on one GPU (`inplace_memory_scan`), the
tokens length-bucketing saves (`padding_report`) and whether h is signal or forward rounding at the paper's ε
(`h_precision_check`)."""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import torch

from experiments.zo_paper.data import PaperData, _as_buckets
from experiments.zo_paper.length_buckets import Buckets, Split, bucketed_ce
from experiments.zo_paper.steps import PAPER, ZOParamStepper, batch_rows
from trainer.zo.probes import canonical_blocks


def inplace_memory_scan(device: str = "cuda",
                        sizes: tuple[str, ...] = ("gpt-55b", "gpt-60b", "gpt-66b", "gpt-70b", "gpt-73b"),
                        seq_len: int = 1024) -> dict[str, Any]:
    """Largest GPT (batch 1 x seq_len) that takes two 1.5-SPSA(K=2) steps with bf16 weights perturbed and
    updated in place (2 bytes per parameter, no fp32 master), trying `sizes` in order until one runs out of
    memory. Returns {"gpu", "gpu_bytes", "trials": [{shape, params, ok, peak_bytes, seconds, error}], "largest"}.
    The default sizes bracket 8x AdamW's 6.7B on one H200 (53.6B): 55.2B, 60.0B, 65.7B, 69.8B, 73.4B (at the
    30B trial's 2.07 bytes per parameter, 69.8B needs ~144 GB of the 150 GB). ~10 s per trial.
    Raises RuntimeError without CUDA, ValueError for an unknown shape."""
    from experiments.headline.bench import _build_shape
    from trainer.models.losses import lm_batch_loss

    shapes = {"gpt-13b": (40, 40, 5120), "gpt-30b": (48, 56, 7168), "gpt-45b": (56, 64, 8192),
              "gpt-55b": (68, 64, 8192), "gpt-60b": (74, 64, 8192), "gpt-66b": (64, 72, 9216),
              "gpt-70b": (68, 72, 9216), "gpt-73b": (72, 72, 9216)}
    if not torch.cuda.is_available():
        raise RuntimeError("the memory scan needs a CUDA GPU")
    bad = [s for s in sizes if s not in shapes]
    if bad:
        raise ValueError(f"unknown shapes {bad}; choose from {sorted(shapes)}")
    torch.zeros(1, device=device)
    trials, largest = [], None
    for name in sizes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        t0, model, err = time.perf_counter(), None, None
        try:
            model = _build_shape(*shapes[name], torch.bfloat16, device, seed=0)
            n = sum(p.numel() for p in model.parameters())
            x = torch.randint(0, 50257, (1, seq_len), device=device)
            st = ZOParamStepper(model, "1.5spsa", numerics="inplace", probes=2)
            for s in range(2):
                st.step(s, (x, x), lm_batch_loss, 1e-6, 1e-3)
            torch.cuda.synchronize(device)
            ok = True
            del st, x  # the stepper holds the weights: drop it, or the next shape starts with this one resident
        except torch.OutOfMemoryError as exc:
            ok, err = False, str(exc).splitlines()[0][:160]
            n = None
        peak = torch.cuda.max_memory_allocated(device)
        model = st = x = None  # noqa: F841 - release every reference before the next shape
        gc.collect()
        torch.cuda.empty_cache()
        trials.append({"shape": name, "params": n, "ok": ok, "peak_bytes": peak,
                       "seconds": time.perf_counter() - t0, "error": err})
        print(json.dumps(trials[-1]), flush=True)
        if not ok:
            break
        largest = name
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "gpu_bytes": props.total_memory, "batch": 1, "seq_len": seq_len,
            "trials": trials, "largest": largest}


def padding_report(data: PaperData | None = None, iterations: int = 75, batch_size: int = PAPER.batch_size,
                   seed: int = 0) -> dict[str, Any]:
    """Tokens per forward of the paper's training batches, padded to the longest row vs length-bucketed
    (data.max_chunks / data.min_rows), averaged over batches 0..iterations-1 (CPU; no model). `data` defaults
    to the SmolLM2 splits from the cache. Returns {"train_mean_len", "train_max_len", "tokens_per_batch"
    {"real", "one_chunk", "bucketed"}, "one_chunk_over_real", "bucketed_over_real", "speedup_tokens"}."""
    from experiments.zo_paper.length_buckets import padded_tokens

    if data is None:
        from experiments.zo.bench import sentiment_task

        data = PaperData.from_task(sentiment_task("smollm2", "cpu"))
    lens = data.lengths["train"]
    tot = {"real": 0, "one_chunk": 0, "bucketed": 0}
    for it in range(iterations):
        p = padded_tokens(lens[batch_rows(seed, it, lens.numel(), batch_size)], data.max_chunks, data.min_rows)
        for k in tot:
            tot[k] += p[k]
    per = {k: v / iterations for k, v in tot.items()}
    return {"train_mean_len": float(lens.float().mean()), "train_max_len": int(lens.max()),
            "tokens_per_batch": per, "one_chunk_over_real": per["one_chunk"] / per["real"],
            "bucketed_over_real": per["bucketed"] / per["real"], "speedup_tokens": per["one_chunk"] / per["bucketed"]}


@torch.no_grad()
def h_precision_check(model: torch.nn.Module, batch: Buckets | Split, seeds: list[int], eps_list=(1e-4, 1e-3),
                      repeats: int = 2) -> dict[str, Any]:
    """Is h = (L+ + L− − 2 L0)/ε² signal or forward-rounding noise at the paper's ε (`batch`: PaperData.batch
    chunks or one (ids, mask, labels))? For each ε: h of each Rademacher probe in `seeds` (out-of-place
    perturbation of the model's own dtype), and the spread of L0 over `repeats` identical forwards (its
    run-to-run noise). Returns {"dtype", "l0": [...], "by_eps": {eps: {"h": [...], "g": [...]}}}; the model is
    left unchanged."""
    from probe_kernels import perturb_model

    def loss(m):
        return float(bucketed_ce(m, _as_buckets(batch))[0])
    blocks = canonical_blocks(model)
    params, offsets = [b.param.data for b in blocks], [b.offset for b in blocks]
    clean = [p.clone() for p in params]
    l0s = [loss(model) for _ in range(repeats)]
    out: dict[str, Any] = {"dtype": str(params[0].dtype), "l0": l0s, "by_eps": {}}
    for eps in eps_list:
        hs, gs = [], []
        for s in seeds:
            lpm = []
            for a in (eps, -eps):
                perturb_model(clean, offsets, s, a, "rademacher", outs=params)
                lpm.append(loss(model))
            for p, c in zip(params, clean):
                p.copy_(c)
            hs.append((lpm[0] + lpm[1] - 2 * l0s[0]) / eps ** 2)
            gs.append((lpm[0] - lpm[1]) / (2 * eps))
        out["by_eps"][str(eps)] = {"h": hs, "g": gs}
    return out
