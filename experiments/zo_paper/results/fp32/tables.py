"""Markdown tables of RESULTS.md, computed from this folder's paper_summary.json and inplace_memory.json.

Run: python3 experiments/zo_paper/results/fp32/tables.py   (stdlib only; prints markdown to stdout).
Accuracies in percent (binomial SE from the summary), h in loss units / eps^2, w dimensionless.
"""
import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).resolve().parent
S = json.loads((HERE / "paper_summary.json").read_text())
MEM = json.loads((HERE / "inplace_memory.json").read_text())
FT = json.loads((HERE / "forward_timing.json").read_text())
LABEL = {"A1": "1.5-SPSA, fp32 master (true fp32)", "A2": "1.5-SPSA, bf16 in place", "A3": "1SPSA (lr 1e-4)",
         "A5-3e-05": "MeZO (batch 16, ε 1e-3)", "A6-5e-05": "AdamW backprop"}


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def arms_table() -> None:
    print("| arm | method | lr | batch | iterations (stop) | sequence-forwards | selected it. | val acc ± SE "
          "| test acc ± SE (once, on the val pick) | best-on-test (PEEK, it.) | start test | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, a in S["arms"].items():
        fw = f"{a['seq_forwards']:,}" + (" (+ backward)" if a.get("seq_backwards") else "")
        peek = a["best_on_test_peek"]
        print(f"| {name} | {LABEL.get(name, a['method'])} | {a['lr']:g} | {a['batch_size']} | {a['iterations']} "
              f"({a['stop']}) | {fw} | {a['selected_iteration']} | {pct(a['val_acc'])} ± {pct(a['val_se'])} "
              f"| {pct(a['test_acc'])} ± {pct(a['test_se'])} | {pct(peek['test_acc'])} ({peek['iteration']}) "
              f"| {pct(a['initial_test_acc'])} | {a['wall_s']:.0f} |")


def a1_vs_a3() -> None:
    e1 = {e["iteration"]: e for e in S["arms"]["A1"]["evals"]}
    e3 = {e["iteration"]: e for e in S["arms"]["A3"]["evals"]}
    its = sorted(set(e1) & set(e3) - {0})
    print("| iteration | A1 val | A3 val | A1 − A3 val | A1 test | A3 test | A1 − A3 test |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    dv, dt = [], []
    for i in its:
        v1, v3, t1, t3 = e1[i]["val_acc"], e3[i]["val_acc"], e1[i]["test_acc_peek"], e3[i]["test_acc_peek"]
        dv.append(v1 - v3)
        dt.append(t1 - t3)
        print(f"| {i} | {pct(v1)} | {pct(v3)} | {100 * (v1 - v3):+.1f} | {pct(t1)} | {pct(t3)} | {100 * (t1 - t3):+.1f} |")
    print(f"| mean over {its[0]}..{its[-1]} | | | {100 * st.mean(dv):+.2f} | | | {100 * st.mean(dt):+.2f} |")
    print(f"\nA1 ahead on test at {sum(d > 0 for d in dt)} of {len(dt)} evaluations, tied at "
          f"{sum(d == 0 for d in dt)}, behind at {sum(d < 0 for d in dt)}; on val ahead/tied/behind "
          f"{sum(d > 0 for d in dv)}/{sum(d == 0 for d in dv)}/{sum(d < 0 for d in dv)}.")
    l1, l3 = S["ledgers"]["A1"], S["ledgers"]["A3"]
    n = min(len(l1), len(l3))
    same = all(l1[i][0] == l3[i][0] for i in range(n))
    r = [sum(abs(c) for c in l1[i][1]) / sum(abs(c) for c in l3[i][1]) for i in range(n)]
    print(f"Same probe seeds in iterations 1..{n}: {same}; Σ|c_k| A1/A3 per iteration: mean {st.mean(r):.2f}, "
          f"min {min(r):.2f}, max {max(r):.2f}.")


def hw_table() -> None:
    keys = ("h_mean", "h_std", "w_mean", "frac_weight_floored", "g_abs_mean")
    print("| arm | statistic (per iteration) | mean | median | min | max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("A1", "A2"):
        log = S["arms"][name]["log"]
        for k in keys:
            v = [r[k] for r in log]
            print(f"| {name} ({len(v)} it.) | {k} | {st.mean(v):.4g} | {st.median(v):.4g} | {min(v):.4g} | {max(v):.4g} |")
        neg = sum(r["h_mean"] < 0 for r in log)
        print(f"| {name} | iterations with h_mean < 0 | {neg} | | | |")


def timing_table() -> None:
    names = {"fp32_highest": "true fp32 (`highest`)", "fp32_tf32": "TF32 (`high`)", "bf16": "bf16"}
    print("| numerics | one padded chunk | 4 buckets | bucketed speed-up |")
    print("| --- | --- | --- | --- |")
    for k, label in names.items():
        one, buck = FT[f"{k}_one_chunk_s"], FT[f"{k}_bucketed_s"]
        print(f"| {label} | {one:.3f} s | {buck:.3f} s | {one / buck:.2f}× |")


def memory_table() -> None:
    print("| shape | parameters | ok | peak GB (GiB) | bytes / parameter | × AdamW's 6.7B |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in MEM["trials"]:
        p = t["params"]
        print(f"| {t['shape']} | {p / 1e9:.1f}B | {t['ok']} | {t['peak_bytes'] / 1e9:.1f} ({t['peak_bytes'] / 2**30:.1f}) "
              f"| {t['peak_bytes'] / p:.2f} | {p / 6.7e9:.1f} |" if p else
              f"| {t['shape']} | (not built) | {t['ok']} | {t['peak_bytes'] / 1e9:.1f} ({t['peak_bytes'] / 2**30:.1f}) "
              f"at the failure | | |")
    print(f"\nGPU total {MEM['gpu_bytes'] / 1e9:.1f} GB ({MEM['gpu_bytes'] / 2**30:.1f} GiB); largest: {MEM['largest']}.")


if __name__ == "__main__":
    for title, fn in (("forward timing", timing_table), ("arms", arms_table), ("A1 vs A3", a1_vs_a3), ("h/w", hw_table), ("memory", memory_table)):
        print(f"\n### {title}\n")
        fn()
    print("\n### drift\n")
    print(json.dumps(S["drift"], indent=1))
