"""`sparecycles bench probe`: a worker's probe throughput on one GPU, fast path against the reference.

Per GPT-2 preset (bf16, sdpa attention, random weights from a fixed seed, tokens at (batch, seq_len)):
- reference: `ProbeEvaluator` (per-unit hooks, eager forward): clean forward and one probe;
- whole-model eager: `WholeModelEvaluator(compile=False)`; its losses must equal the reference's bit for bit;
- fast: `WholeModelEvaluator` compiled (optionally CUDA graphs): compile seconds, the clean forward of the
  compiled model, one probe end to end (perturb launch + forward + loss + the host read of the float),
  probes/s (one perturbed forward + loss each), the same pipelined as a worker runs a task (4 seeds x +-
  queued, one wait) against 8 queued clean forwards (each pair timed alternately `rounds` times: the overhead
  is the median of the per-round ratios; plus the GPU kernel time per call from torch.profiler, so the
  overhead splits into kernels added and GPU idle), forward MFU against a measured 8192^3 bf16 matmul, parity
  against the reference on `parity_seeds` seeds (max |dL|, max |d(L+ - L-)|), and determinism (the same
  seeds again, and in a second process when `child` is set).
Times are medians of `triton.testing.do_bench` (CUDA events). Needs a CUDA device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from probe_kernels.bench import _ms, forward_flops, preset_config
from probe_kernels.dist import as_dist
from probe_kernels.evaluator import ProbeEvaluator
from probe_kernels.fastpath import WholeModelEvaluator, model_bytes


def lm_loss(model, batch):
    """Mean token cross-entropy (nats): trainer.train.lm_loss's arithmetic (kernels may not import trainer)."""
    x, y = batch
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def build(preset: str, batch: int, seq_len: int, device: str = "cuda"):
    """(model bf16 eval on `device`, (x, y) int64 (batch, seq_len)), both pure functions of the preset."""
    from transformers import GPT2LMHeadModel

    cfg = preset_config(preset)
    cfg._attn_implementation = "sdpa"
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.device(dev):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator(device=dev).manual_seed(1)
    t = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=dev, generator=g)
    return model, (t[:, :-1].contiguous(), t[:, 1:].contiguous())


def loss_bits(preset: str, batch: int, seq_len: int, cuda_graphs: bool, seeds: int, eps: float = 1e-3) -> list[str]:
    """float.hex of L0 and of L(+-eps z_s) for s < seeds through the compiled fast path (determinism check)."""
    model, b = build(preset, batch, seq_len)
    fast = WholeModelEvaluator(model, lm_loss, compile=True, cuda_graphs=cuda_graphs)
    out = [fast.clean_loss(b).hex()]
    for s in range(seeds):
        out += [fast.loss(b, s, eps).hex(), fast.loss(b, s, -eps).hex()]
    return out


def _parity(ref_vals: list[tuple[float, float]], vals: list[tuple[float, float]]) -> dict:
    d = [abs(a - b) for r, v in zip(ref_vals, vals) for a, b in zip(r, v)]
    rel = [abs(a - b) / abs(a) for r, v in zip(ref_vals, vals) for a, b in zip(r, v)]
    dd = [abs((r[0] - r[1]) - (v[0] - v[1])) for r, v in zip(ref_vals, vals)]
    spread = [abs(r[0] - r[1]) for r in ref_vals]
    return {"seeds": len(vals), "bit_equal": sum(a == b for r, v in zip(ref_vals, vals) for a, b in zip(r, v)),
            "values": 2 * len(vals), "max_abs": max(d), "max_rel": max(rel), "mean_abs": sum(d) / len(d),
            "max_abs_diff_of_lplus_minus_lminus": max(dd), "median_abs_lplus_minus_lminus": sorted(spread)[len(spread) // 2]}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _paired(clean, probe, rounds: int, rep: int) -> tuple[list[float], list[float]]:
    """ms of `clean` and of `probe` (do_bench medians), alternated `rounds` times: two lists."""
    a, b = [], []
    for _ in range(rounds):
        a.append(_ms(clean, rep=rep))
        b.append(_ms(probe, rep=rep))
    return a, b


def _kernel_ms(fn, calls: int = 3) -> float:
    """GPU time (ms) of the kernels and copies one call of `fn` launches (torch.profiler, `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / calls


def _top_kernels(fn, top: int = 8) -> list[tuple[str, float]]:
    """[(kernel name (80 chars), GPU ms per call of `fn`)] of the `top` costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:top]
    return [(e.key[:80], e.self_device_time_total / 1e3) for e in rows]


def _pipelined(fast: WholeModelEvaluator, b, eps: float, rounds: int, res: dict) -> None:
    """Into `res` (and its "ms"): a task's probes pipelined (WholeModelEvaluator.losses: one wait per 4 seeds x +-),
    as the worker runs them, against 8 clean forwards; with the GPU kernel time per call; or "pipelined_error"."""
    ms = res["ms"]
    try:  # a task's probes pipelined (WholeModelEvaluator.losses: one wait per 4 seeds x +-), as the worker runs them
        def clean8():
            return torch.stack([fast._launch(b) for _ in range(8)]).tolist()

        def task8():
            return fast.losses(b, [11, 12, 13, 14], eps)

        cl8, pr8 = _paired(clean8, task8, rounds, rep=400)
        ms["fast_clean_pipelined"], ms["fast_probe_pipelined"] = _median(cl8) / 8, _median(pr8) / 8
        res["overhead_pipelined_rounds"] = [p / c - 1 for c, p in zip(cl8, pr8)]
        res["overhead_pipelined"] = _median(res["overhead_pipelined_rounds"])
        res["probes_per_s_pipelined"] = 1e3 / ms["fast_probe_pipelined"]
        # where the difference goes: GPU kernel time per call (torch.profiler) against the wall above
        res["kernel_ms_per_probe_pipelined"] = _kernel_ms(task8) / 8
        res["kernel_ms_per_clean_pipelined"] = _kernel_ms(clean8) / 8
        res["top_kernels_probe_task"] = _top_kernels(task8)
    except Exception as exc:  # noqa: BLE001 - the per-call figures above still count
        res["pipelined_error"] = repr(exc)[:1000]


def bench_one(preset: str, batch: int, seq_len: int, parity_seeds: int, cuda_graphs: bool, peak: float,
              eps: float = 1e-3, eager_parity: bool = True, rounds: int = 5) -> dict:
    """All measurements of one preset (see the module docstring) as a JSON-ready dict."""
    model, b = build(preset, batch, seq_len)
    flops = forward_flops(model, batch, seq_len)
    seeds = list(range(parity_seeds))
    res: dict = {"preset": preset, "batch": batch, "seq_len": seq_len, "numel": sum(p.numel() for p in model.parameters()),
                 "model_gb": model_bytes(model) / 1e9, "forward_flops": flops, "cuda_graphs": cuda_graphs, "ms": {}}
    ms = res["ms"]
    ref = ProbeEvaluator(model, lm_loss)
    ms["reference_clean"] = _ms(lambda: ref.loss(b), rep=1000)
    ms["reference_probe"] = _ms(lambda: ref.loss(b, 11, eps), rep=1000)
    ref_vals = [(ref.loss(b, s, eps), ref.loss(b, s, -eps)) for s in seeds]
    ref_l0 = ref.clean_loss(b)
    ref.close()
    if eager_parity:
        whole = WholeModelEvaluator(model, lm_loss, compile=False)
        ms["whole_eager_probe"] = _ms(lambda: whole.loss(b, 11, eps), rep=1000)
        vals = [(whole.loss(b, s, eps), whole.loss(b, s, -eps)) for s in seeds]
        res["parity_whole_eager"] = {**_parity(ref_vals, vals), "l0_equal": whole.clean_loss(b) == ref_l0}
        whole.close()
    fast = WholeModelEvaluator(model, lm_loss, compile=True, cuda_graphs=cuda_graphs)
    l0 = fast.clean_loss(b)
    res["compile_s"], res["compiled"] = fast.compile_seconds, fast.compiled
    res["inductor_deterministic"] = fast.inductor_deterministic
    res["padded_head"], res["eager_mask_builders"] = fast.padded_head, fast.eager_masks
    fast.loss(b, 11, eps)  # warm: the first perturb launch builds the plan's table
    # clean and probe timed alternately (rounds x do_bench each), so drift between two timings of the same
    # forward (1.3% in an earlier call) does not enter the overhead; overhead = median of per-round ratios
    cl, pr = _paired(lambda: fast.forward_loss(b), lambda: fast.loss(b, 11, eps), rounds, rep=400)
    ms["fast_clean_forward"], ms["fast_probe"] = _median(cl), _median(pr)
    ms["fast_clean_forward_again"] = min(cl)
    res["overhead_rounds"] = [p / c - 1 for c, p in zip(cl, pr)]
    plan = fast._plan(as_dist("gauss8"))
    ms["fast_perturb_only"] = _ms(lambda: plan.perturb(11, eps))
    _pipelined(fast, b, eps, rounds, res)
    vals = [(fast.loss(b, s, eps), fast.loss(b, s, -eps)) for s in seeds]
    again = [(fast.loss(b, s, eps), fast.loss(b, s, -eps)) for s in seeds[:10]]
    res["parity_fast"] = {**_parity(ref_vals, vals), "l0_abs": abs(l0 - ref_l0)}
    res["deterministic_repeat"] = again == vals[:10] and fast.clean_loss(b) == l0
    res["bits"] = [l0.hex()] + [v.hex() for pair in vals[:5] for v in pair]
    fast.close()
    torch.cuda.empty_cache()
    clean = ms["fast_clean_forward"]
    res.update({
        "probes_per_s": 1e3 / ms["fast_probe"], "reference_probes_per_s": 1e3 / ms["reference_probe"],
        "speedup_vs_reference": ms["reference_probe"] / ms["fast_probe"],
        "overhead_end_to_end": _median(res["overhead_rounds"]),
        "perturb_over_forward": ms["fast_perturb_only"] / clean,
        "mfu_probe": flops / (ms["fast_probe"] * 1e-3) / peak, "mfu_clean": flops / (clean * 1e-3) / peak,
        "mfu_reference": flops / (ms["reference_probe"] * 1e-3) / peak,
    })
    return res


def matmul_peak() -> float:
    """Measured bf16 FLOP/s of an 8192^3 matmul on random data (the MFU denominator)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    return 2 * 8192**3 / (_ms(lambda: a @ bm, rep=500) * 1e-3)


def run_probe_bench(presets: list[str], batch: int = 16, seq_len: int = 1024, parity_seeds: int = 100,
                    cuda_graphs: bool = False, child: bool = False, out=None) -> dict:
    """Bench every preset; writes the dict to `out` (a path) after each step when given. Raises RuntimeError
    without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench probe needs a CUDA device (run it on a GPU machine)")
    for p in presets:
        preset_config(p)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "batch": batch, "seq_len": seq_len, "cuda_graphs": cuda_graphs, "presets": []}
    res["matmul_bf16_tflops_measured"] = matmul_peak() / 1e12

    def save():
        if out is not None:
            with open(out, "w") as f:
                json.dump(res, f, indent=2)

    for i, p in enumerate(presets):
        n = parity_seeds if i == 0 else max(1, parity_seeds // 10)  # the larger models: fewer seeds
        try:
            res["presets"].append(bench_one(p, batch, seq_len, n, cuda_graphs, res["matmul_bf16_tflops_measured"] * 1e12,
                                            rounds=5 if i == 0 else 2))
        except Exception as exc:  # noqa: BLE001 - keep what the other presets measured
            res["presets"].append({"preset": p, "error": repr(exc)[:2000]})
        save()
        if child and i == 0 and "bits" in res["presets"][0]:
            cmd = [sys.executable, "-m", "probe_kernels.bench_probe", p, str(batch), str(seq_len), str(int(cuda_graphs))]
            t0 = time.perf_counter()
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            try:
                bits = json.loads(got.stdout.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                bits = None
            res["presets"][0]["cross_process_bits_equal"] = bits == res["presets"][0]["bits"]
            res["presets"][0]["cross_process_s"] = time.perf_counter() - t0
            if bits is None:
                res["presets"][0]["cross_process_error"] = got.stderr[-2000:]
            save()
    return res


def render(res: dict) -> None:
    """Print the headline figures as a rich table."""
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"probe throughput, {res['device']}, bf16 {res['batch']}x{res['seq_len']}, "
                      f"matmul {res['matmul_bf16_tflops_measured']:.0f} TFLOP/s measured")
    cols = ("preset", "ref ms", "fast clean ms", "fast probe ms", "probes/s", "x ref", "overhead", "MFU",
            "parity max|dL|", "compile s")
    for c in cols:
        tab.add_column(c, justify="left" if c == "preset" else "right")
    for r in res["presets"]:
        if "error" in r:
            tab.add_row(r["preset"], *(["error"] + [""] * (len(cols) - 2)))
            continue
        ms = r["ms"]
        tab.add_row(r["preset"], f"{ms['reference_probe']:.2f}", f"{min(ms['fast_clean_forward'], ms['fast_clean_forward_again']):.2f}",
                    f"{ms['fast_probe']:.2f}", f"{r['probes_per_s']:.1f}", f"{r['speedup_vs_reference']:.2f}",
                    f"{r['overhead_end_to_end']:.2%}", f"{r['mfu_probe']:.1%}", f"{r['parity_fast']['max_abs']:.2e}",
                    f"{r['compile_s']:.0f}")
    Console().print(tab)


def profile_fast(preset: str = "gpt2-small", batch: int = 16, seq_len: int = 1024, top: int = 15) -> str:
    """torch.profiler table of the compiled fast path's clean forward (CUDA time per kernel), as text."""
    from torch.profiler import ProfilerActivity, profile

    model, b = build(preset, batch, seq_len)
    fast = WholeModelEvaluator(model, lm_loss)
    fast.clean_loss(b)
    for _ in range(3):
        fast.forward_loss(b)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fast.forward_loss(b)
    head = f"{preset}: padded head {fast.padded_head}, mask builders run eagerly {fast.eager_masks}\n"
    return head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)


if __name__ == "__main__":  # child of run_probe_bench: PRESET BATCH SEQ_LEN CUDA_GRAPHS -> bits as JSON
    p, bsz, sl, cg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4]))
    print(json.dumps(loss_bits(p, bsz, sl, cg, 5)))
