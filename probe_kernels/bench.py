"""GPU benchmark of the probe kernels against a device copy and naive PyTorch (``sparecycles bench kernels``).

Effective bandwidth = minimal bytes (each weight read once and written once) / median time. Times are
medians of ``triton.testing.do_bench`` (CUDA events, warm-up first). Needs a CUDA device and triton.
"""

from __future__ import annotations

import torch

from probe_kernels.dist import ProbeDist, as_dist
from probe_kernels.evaluator import ProbeEvaluator, canonical_offsets
from probe_kernels.ops import ModelPlan, perturb, perturb_model, triton_available

PRESETS = {  # GPT-2 family shapes (Sophia's settings; DESIGN.md section 2)
    "gpt2-small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
}


def preset_config(name: str):
    """transformers.GPT2Config of a preset (vocab 50257, context 1024); raises ValueError if unknown."""
    from transformers import GPT2Config

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return GPT2Config(vocab_size=50257, n_positions=1024, **PRESETS[name])


def preset_sizes(name: str) -> list[int]:
    """numel of each parameter in canonical order (tied weights once), built on the meta device."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(preset_config(name))
    return [p.numel() for _, p in model.named_parameters()]



def preset_tensors(sizes: list[int], dev: torch.device, gen: torch.Generator):
    """The list kernels' benchmark inputs over parameter `sizes` (numel each), drawn from `gen` in this order:
    (offs, w16, out16, w32) = start offsets (each tensor's first element in the flat Philox stream), bf16
    weights (randn), empty bf16 outputs beside them, fp32 weights (randn); each a list of 1-D tensors on `dev`."""
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    w16 = [torch.randn(s, device=dev, generator=gen).to(torch.bfloat16) for s in sizes]
    out16 = [torch.empty_like(w) for w in w16]
    w32 = [torch.randn(s, device=dev, generator=gen) for s in sizes]
    return offs, w16, out16, w32

def _ms(fn, rep: int = 200) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep, return_mode="median"))


def bench_preset(name: str, dist: ProbeDist, k: int) -> dict:
    """Times (ms) and effective bandwidths (GB/s) of perturb and replay over one preset's parameter sizes.

    "one_launch" rows launch through a prepared `ModelPlan` (the kernel alone); "list_api" rows call
    perturb_model, whose per-call Python over every tensor is included. Replay is timed for both
    distributions (`dist` first)."""
    dev = torch.device("cuda")
    sizes = preset_sizes(name)
    n = sum(sizes)
    gen = torch.Generator(device=dev).manual_seed(0)
    offs, w16, out16, w32 = preset_tensors(sizes, dev, gen)
    src16, dst16 = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16), torch.empty(n, device=dev,
                                                                                           dtype=torch.bfloat16)
    src32, dst32 = torch.randn(n, device=dev, generator=gen), torch.empty(n, device=dev)
    seeds = torch.arange(1, k + 1, dtype=torch.int64, device=dev) * 1_000_003
    coeffs = torch.linspace(-1e-4, 1e-4, k, device=dev)

    def naive_perturb():  # MeZO: torch.normal per parameter tensor, then an in-place add
        for w in w16:
            w.add_(torch.randn(w.shape, device=dev, dtype=w.dtype, generator=gen), alpha=1e-3)

    def naive_replay():
        for j in range(k):
            for w in w32:
                w.add_(torch.randn(w.shape, device=dev, generator=gen), alpha=float(coeffs[j]))

    def per_tensor_perturb():
        for w, o, off in zip(w16, out16, offs):
            perturb(w, 7, off, 1e-3, dist, out=o)

    other = ProbeDist.RADEMACHER if dist is ProbeDist.GAUSS8 else ProbeDist.GAUSS8
    plan16, plan32 = ModelPlan(w16, offs, dist, outs=out16), ModelPlan(w32, offs, dist, outs=w32)
    plan32_other = ModelPlan(w32, offs, other, outs=w32)
    t = {
        "copy_bf16": _ms(lambda: dst16.copy_(src16)),
        "copy_fp32": _ms(lambda: dst32.copy_(src32)),
        "perturb_bf16_one_launch": _ms(lambda: plan16.perturb(7, 1e-3)),
        "perturb_bf16_list_api": _ms(lambda: perturb_model(w16, offs, 7, 1e-3, dist, outs=out16)),
        "perturb_bf16_per_tensor": _ms(per_tensor_perturb),
        "axpy_fp32_one_launch": _ms(lambda: plan32.perturb(7, 1e-7)),
        f"replay_fp32_k{k}_one_launch": _ms(lambda: plan32.replay_(seeds, coeffs)),
        f"replay_fp32_k{k}_one_launch_{other.value}": _ms(lambda: plan32_other.replay_(seeds, coeffs)),
        "naive_perturb_bf16": _ms(naive_perturb),
        f"naive_replay_fp32_k{k}": _ms(naive_replay, rep=50),
    }
    b16, b32 = 4 * n, 8 * n  # bytes read + written per pass
    bw = {key: (b16 if "bf16" in key else b32) / (ms * 1e-3) / 1e9 for key, ms in t.items()}
    return {
        "preset": name, "numel": n, "tensors": len(sizes), "dist": dist.value, "k": k, "ms": t, "GBps": bw,
        "frac_of_copy": {key: bw[key] / bw["copy_bf16" if "bf16" in key else "copy_fp32"] for key in t},
        "replay_over_perturb_bf16": t[f"replay_fp32_k{k}_one_launch"] / t["perturb_bf16_one_launch"],
        "replay_over_axpy_fp32": t[f"replay_fp32_k{k}_one_launch"] / t["axpy_fp32_one_launch"],
        "other_dist": other.value,
        "replay_other_over_perturb_bf16": t[f"replay_fp32_k{k}_one_launch_{other.value}"]
        / t["perturb_bf16_one_launch"],
        "replay_other_over_axpy_fp32": t[f"replay_fp32_k{k}_one_launch_{other.value}"] / t["axpy_fp32_one_launch"],
        "naive_replay_over_replay": t[f"naive_replay_fp32_k{k}"] / t[f"replay_fp32_k{k}_one_launch"],
    }


H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA H200 SXM datasheet, dense bf16 (the H100's rate)


def forward_flops(model: torch.nn.Module, batch: int, seq_len: int) -> float:
    """Matmul FLOPs of one GPT-2 forward at (batch, seq_len): 2·N + 4·L·d·T per token (PaLM, Chowdhery et
    al. 2022, appendix B: training is 6N + 12·L·H·Q·T; a forward is a third of it). N counts every weight
    used in a matmul: all parameters but the position table (the tied token table counts once, as the
    LM head)."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    return batch * seq_len * (2.0 * n + 4.0 * cfg.n_layer * cfg.n_embd * seq_len)


def bench_forward(dist: ProbeDist, batch: int, seq_len: int) -> dict:
    """Per-probe perturbation overhead vs one bf16 forward (with loss) of gpt2-small at (batch, seq_len)."""
    from transformers import GPT2LMHeadModel

    dev = torch.device("cuda")
    model = GPT2LMHeadModel(preset_config("gpt2-small")).to(dev, torch.bfloat16).eval()
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, 50257, (batch, seq_len), device=dev, generator=gen)
    ev = ProbeEvaluator(model, lambda m, b: m(input_ids=b, labels=b).loss)
    rows = canonical_offsets(model)
    ps, offs = [p.detach() for _, p, _ in rows], [o for _, _, o in rows]
    scratch = [torch.empty_like(p) for p in ps]
    plan = ModelPlan(ps, offs, dist, outs=scratch)

    def naive():
        for p, s in zip(ps, scratch):
            torch.add(p, torch.randn(p.shape, device=dev, dtype=p.dtype, generator=gen), alpha=1e-3, out=s)

    with torch.no_grad():
        t = {
            "forward_clean": _ms(lambda: ev.loss(x), rep=1000),
            "forward_probe": _ms(lambda: ev.loss(x, 11, 1e-3, dist), rep=1000),
            "perturb_model_one_launch": _ms(lambda: plan.perturb(11, 1e-3)),
            "naive_perturb_pass": _ms(naive),
        }
        t["forward_clean_again"] = _ms(lambda: ev.loss(x), rep=1000)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=gen)
        t["matmul_8192_bf16"] = _ms(lambda: a @ a, rep=200)
    ev.close()
    fwd = min(t["forward_clean"], t["forward_clean_again"])
    flops = forward_flops(model, batch, seq_len)
    peak_measured = 2 * 8192**3 / (t["matmul_8192_bf16"] * 1e-3)
    return {
        "batch": batch, "seq_len": seq_len, "dist": dist.value, "ms": t,
        "probes_per_s": 1e3 / t["forward_probe"], "tokens_per_s": batch * seq_len * 1e3 / t["forward_probe"],
        "forward_flops": flops, "matmul_tflops_measured": peak_measured / 1e12,
        "forward_mfu_vs_measured_matmul": flops / (t["forward_probe"] * 1e-3) / peak_measured,
        "forward_mfu_vs_datasheet": flops / (t["forward_probe"] * 1e-3) / H200_BF16_DENSE_FLOPS,
        "probe_overhead_end_to_end": (t["forward_probe"] - fwd) / fwd,
        "kernel_pass_over_forward": t["perturb_model_one_launch"] / fwd,
        "naive_pass_over_forward": t["naive_perturb_pass"] / fwd,
    }


def run_bench(presets: list[str], dist: ProbeDist | str = ProbeDist.GAUSS8, k: int = 40, batch: int = 16,
              seq_len: int = 1024, forward: bool = True) -> dict:
    """All measurements as a JSON-ready dict; raises RuntimeError without CUDA or triton."""
    dist = as_dist(dist)
    for p in presets:
        preset_config(p)
    if not torch.cuda.is_available() or not triton_available():
        raise RuntimeError("bench kernels needs a CUDA device and triton (run it on a GPU machine)")
    from probe_kernels.triton_kernels import TUNING

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tuning": {f"{kind}/{esize}B/{d or 'any'}": list(cfg) for (kind, esize, d), cfg in TUNING.items()},
           "presets": [bench_preset(p, dist, k) for p in presets]}
    import triton

    res["triton"] = triton.__version__
    if forward:
        res["forward"] = bench_forward(dist, batch, seq_len)
    return res


def render(res: dict) -> None:
    """Print the results as rich tables."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for pr in res["presets"]:
        tab = Table(title=f"{pr['preset']}: {pr['numel'] / 1e6:.1f}M params in {pr['tensors']} tensors, "
                          f"{pr['dist']}, {res['device']}")
        for col in ("op", "ms (median)", "GB/s (read+write)", "x copy bw"):
            tab.add_column(col, justify="right" if col != "op" else "left")
        for key, ms in pr["ms"].items():
            tab.add_row(key, f"{ms:.3f}", f"{pr['GBps'][key]:.0f}", f"{pr['frac_of_copy'][key]:.1%}")
        con.print(tab)
        con.print(f"replay K={pr['k']} {pr['dist']} / perturb bf16 pass: {pr['replay_over_perturb_bf16']:.2f}x; "
                  f"/ axpy fp32 pass: {pr['replay_over_axpy_fp32']:.2f}x; naive replay is "
                  f"{pr['naive_replay_over_replay']:.1f}x slower")
        con.print(f"replay K={pr['k']} {pr['other_dist']} / perturb bf16 pass: "
                  f"{pr['replay_other_over_perturb_bf16']:.2f}x; / axpy fp32 pass: "
                  f"{pr['replay_other_over_axpy_fp32']:.2f}x")
    if "forward" in res:
        f = res["forward"]
        tab = Table(title=f"gpt2-small bf16 forward+loss at {f['batch']}x{f['seq_len']}, {f['dist']}")
        tab.add_column("measure")
        tab.add_column("value", justify="right")
        for key, ms in f["ms"].items():
            tab.add_row(f"{key} (ms)", f"{ms:.3f}")
        tab.add_row("probe overhead, end to end (evaluator)", f"{f['probe_overhead_end_to_end']:.2%}")
        tab.add_row("one fused perturb pass / forward", f"{f['kernel_pass_over_forward']:.2%}")
        tab.add_row("one naive PyTorch perturb pass / forward", f"{f['naive_pass_over_forward']:.2%}")
        tab.add_row("probes/s (one GPU, perturbed forward + loss)", f"{f['probes_per_s']:.1f}")
        tab.add_row("forward MFU vs measured 8192^3 bf16 matmul "
                    f"({f['matmul_tflops_measured']:.0f} TFLOP/s)", f"{f['forward_mfu_vs_measured_matmul']:.1%}")
        tab.add_row("forward MFU vs datasheet 989 TFLOP/s", f"{f['forward_mfu_vs_datasheet']:.1%}")
        con.print(tab)
