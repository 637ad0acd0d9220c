"""`sparecycles bench precision`: which round kinds may run their forward in bf16.

For each round kind, the quantity the round measures (its *signal*) is computed on real batches three ways:
the reference (fp32 weights, fp32 matmuls: torch "highest", eager), TF32 (fp32 weights, TF32 matmuls, compiled:
the worker's path for perturbing kinds) and bf16 (a bf16 copy of the weights, compiled: probe_kernels.FastForward /
WholeModelEvaluator on bf16 weights, as `bench probe`). A precision's *noise* is its signal minus the reference's;
SNR = rms(reference signal) / rms(noise) (`snr`). A kind whose bf16 SNR is at least trainer.zo.probes.SNR_BOUND
may run in bf16 (trainer.zo.probes.KINDS[kind].precision).

Signals (each kind at the ε the trainer gives it):
- seeded, block_scaled, group, along_update, line: L+ − L− (seeded/block_scaled ε = 1e-3; group ε = 1e-3 × the
  group's RMS, as a role round; along_update ε = 1e-3 along the last step's unit-RMS update; line ε = 0.5 along
  θ_v − θ_{v−20}, seeds 1..3, as zocurv-global);
- group_line: L(θ_v + kε d on the group) − L0 (ε = 0.5, k = ±1, ±2, as the trust region's design);
- eval: L(θ_a) − L(θ_b) between the versions of a short training run (what an evaluation curve compares);
- eval_mixture (anytime candidates, eval rounds over weight mixtures): L(c_i) − L(c_j) between candidates;
- teacher (teacher targets): KL(p_teacher || p_student) per token, the distillation loss the student sees;
- seeded_curvature, line_curvature: L+ + L− − 2 L0 (the curvature ZO-Curv reads from those rounds).
A kind may run in bf16 when every row of it clears the bound (`kind_of_row`, `precisions`).

The model is first trained `steps` AdamW steps on real text (the corpus's train split; the batches scored are
its validation split), so the losses and their differences are those of a model that has learned something.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.options import PrecisionOptions
from probe_kernels import FastForward, WholeModelEvaluator, lm_logits
from trainer.anytime.ring import build_mixture
from trainer.data.batches import get_batch
from trainer.models import build_model
from trainer.models.losses import lm_batch_loss
from trainer.zo import probes


def snr(signal: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """Signal-to-noise of `measured` against the reference `signal` (same length n >= 1): rms(signal) /
    rms(measured − signal) (inf for no noise), with the rms values and max |noise|. Raises ValueError for
    lengths that differ or are 0."""
    if len(signal) != len(measured) or not signal:
        raise ValueError(f"need equal, non-zero lengths, got {len(signal)} and {len(measured)}")
    noise = [m - s for s, m in zip(signal, measured)]
    rs = math.sqrt(sum(s * s for s in signal) / len(signal))
    rn = math.sqrt(sum(e * e for e in noise) / len(noise))
    return {"snr": rs / rn if rn > 0 else math.inf, "rms_signal": rs, "rms_noise": rn,
            "max_noise": max(abs(e) for e in noise), "n": len(signal)}


def _site(model: torch.nn.Module, base: torch.nn.Module | None, ev, batch):
    blocks = probes.canonical_blocks(model)
    upd = None
    if base is not None:
        bb = probes.canonical_blocks(base)

        def upd(b: int) -> torch.Tensor:
            return blocks[b].param.detach().float() - bb[b].param.detach().float()
    return probes.ProbeSite(blocks, lambda new: ev.loss_swapped(batch, new), lambda s, a, d: ev.loss(batch, s, a, d), upd)


def _kind_signals(model, prev, far, ev, batches, seeds: int, group: list[int]) -> dict[str, list[float]]:
    """Every perturbing kind's signals on `model` (θ_v) through evaluator `ev` (see the module docstring)."""
    out: dict[str, list[float]] = {}
    for batch in batches:
        s_prev, s_far = _site(model, prev, ev, batch), _site(model, far, ev, batch)
        blocks = s_prev.blocks
        grms = math.sqrt(sum(float(blocks[i].param.detach().float().pow(2).sum()) for i in group)
                         / sum(blocks[i].param.numel() for i in group))
        l0 = ev.clean_loss(batch)
        todo: list[tuple[str, probes.ProbeSite, str, list[int], float, Sequence[int]]] = [
            ("seeded", s_prev, "seeded", list(range(seeds)), 1e-3, ()),
            ("block_scaled", s_prev, "block_scaled", list(range(seeds)), 1e-3, ()),
            ("group", s_prev, "group", list(range(seeds)), 1e-3 * grms, group),
            ("along_update", s_prev, "along_update", [int(b) for b in torch.linspace(0, len(blocks) - 1, seeds)], 1e-3, ()),
            ("line", s_far, "line", [1, 2, 3], 0.5, ()),
            ("group_line", s_far, "group_line", [1, 2, 3, 4], 0.5, group),
        ]
        for name, site, kind, ss, eps, grp in todo:
            for s in ss:
                lp, lm, _ = probes.probe_losses(site, kind, s, eps, "rademacher", grp, l0)
                out.setdefault(name, []).append(lp - l0 if kind == "group_line" else lp - lm)
                if kind in ("seeded", "line"):  # the curvature ZO-Curv reads: L+ + L− − 2 L0
                    out.setdefault(f"{name}_curvature", []).append(lp + lm - 2 * l0)
    return out


@torch.no_grad()
def _eval_signals(fwd: Callable, versions: list[dict], mixtures: list[list[float]], batches) -> dict[str, list[float]]:
    """eval: L(v_i) − L(v_j) over version pairs; eval_mixture: L(c_i) − L(c_{i+1}) over mixture candidates.
    fwd(state_dict, batch) -> loss (float)."""
    out: dict[str, list[float]] = {"eval": [], "eval_mixture": []}
    cands = [build_mixture([(i, c) for i, c in enumerate(coeffs)], lambda i: versions[i]) for coeffs in mixtures]
    for batch in batches:
        lv = [fwd(v, batch) for v in versions]
        out["eval"] += [lv[i] - lv[j] for i in range(len(lv)) for j in range(i + 1, len(lv))]
        lc = [fwd(c, batch) for c in cands]
        out["eval_mixture"] += [lc[i] - lc[i + 1] for i in range(len(lc) - 1)]
    return out


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> float:
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return float((t.exp() * (t - s)).sum(-1).mean())


def _trained_snapshots(o: PrecisionOptions, lr: float) -> tuple[Any, Any, dict[int, dict], list[float]]:
    """o.preset trained o.steps AdamW steps (lr, wd 0) on o.corpus's train split in TF32, with state-dict snapshots
    after steps T-20, T-10, T-1 and T. Returns (the model in eval mode, the corpus, the snapshots, the losses)."""
    from trainer.data.corpus import load_corpus

    cor = load_corpus(o.corpus)
    steps = o.steps
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    model = build_model(o.preset, device=o.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    snaps: dict[int, dict] = {}
    losses = []
    model.train()
    for i in range(steps):
        x, y = (u.to(o.device) for u in get_batch(cor.train, o.batch_size, o.seq_len, seed=0, index=i))
        loss = lm_batch_loss(model, (x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if i + 1 in (steps - 20, steps - 10, steps - 1, steps):
            snaps[i + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.eval(), cor, snaps, losses


def measure(o: PrecisionOptions, lr: float = 1e-3, compile: bool | None = None,
            progress: Callable[[str], None] = print) -> dict:
    """The kind × precision table (module docstring) as a JSON-ready dict: {"rows": {kind: {precision: snr(...)}},
    "settings": ..., "train_loss": [...], "seconds": ...}, for `bench precision`'s options `o` (the model trained
    at `lr` first). compile: the TF32 and bf16 columns' torch.compile (default: on CUDA). Raises what the corpus
    and model loaders raise."""
    t_start = time.perf_counter()
    device, steps, seeds, n_batches, b, t = o.device, o.steps, o.seeds, o.batches, o.batch_size, o.seq_len
    model, cor, snaps, losses = _trained_snapshots(o, lr)
    progress(f"trained {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    batches = [tuple(u.to(device) for u in get_batch(cor.val, b, t, seed=1, index=j)) for j in range(n_batches)]
    group = [i for i, blk in enumerate(probes.canonical_blocks(model)) if ".h.0." in blk.name]  # layer 0's blocks

    def holding(sd, dtype=None):
        m = copy.deepcopy(model)
        m.load_state_dict(sd)
        return m.to(dtype) if dtype is not None else m

    versions = [snaps[steps - 20], snaps[steps - 10], snaps[steps]]
    mixtures = [[0.0, 0.0, 1.0], [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.2, 0.3, 0.5]]
    torch.set_float32_matmul_precision("highest")
    student = holding(snaps[steps - 20]).eval()
    with torch.no_grad():  # the student's logits once, in fp32: only the teacher's precision varies
        student_logits = [student(input_ids=bt[0]).logits.float() for bt in batches]
    del student
    sig: dict[str, dict[str, list[float]]] = {}
    for prec in ("tf32", "tf32_bf16attn", "bf16", "ref"):
        t0 = time.perf_counter()
        torch.set_float32_matmul_precision("highest" if prec == "ref" else "high")
        dtype = torch.bfloat16 if prec == "bf16" else None
        compiled = prec != "ref" and (torch.device(device).type == "cuda" if compile is None else compile)
        v, prev, far = holding(snaps[steps], dtype), holding(snaps[steps - 1], dtype), holding(snaps[steps - 20], dtype)
        ev = WholeModelEvaluator(v, lm_batch_loss, compile=compiled,
                                 attn_dtype=torch.bfloat16 if prec == "tf32_bf16attn" else None)
        got = _kind_signals(v, prev, far, ev, batches, seeds, group)

        def fwd(sd, bt, ev=ev, dtype=dtype):  # the same FastForward, holding another version (as a worker's)
            if not ev.rebind(holding(sd, dtype)):
                raise RuntimeError("rebind refused a version of the same model")
            return ev.clean_loss(bt)
        got.update(_eval_signals(fwd, versions, mixtures, batches))
        ev.close()
        # teacher logits eagerly in every column (one compile per column less; the dtype is what differs)
        teacher = FastForward(v, lm_logits, dtype=None, compile=False,
                              attn_dtype=torch.bfloat16 if prec == "tf32_bf16attn" else None)
        got["teacher"] = [_kl(teacher(bt[0]), sl) for bt, sl in zip(batches, student_logits)]
        teacher.close()
        sig[prec] = got
        progress(f"{prec}: {time.perf_counter() - t0:.1f} s (compile {ev.compile_seconds})")
        del v, prev, far
        torch.cuda.empty_cache() if torch.device(device).type == "cuda" else None
    rows = {k: {p: snr(sig["ref"][k], sig[p][k]) for p in ("tf32", "tf32_bf16attn", "bf16")} for k in sig["ref"]}
    declared = {k.value: r.precision for k, r in probes.KINDS.items()}
    return {"preset": o.preset, "batch": [b, t], "steps": steps, "seeds": seeds, "n_batches": n_batches,
            "corpus": o.corpus, "device": torch.cuda.get_device_name(device) if "cuda" in device else "cpu",
            "torch": torch.__version__, "snr_bound": probes.SNR_BOUND, "declared": declared, "rows": rows,
            "train_loss": [losses[0], losses[-1]], "signals": sig, "seconds": time.perf_counter() - t_start}


def kind_of_row(row: str) -> str:
    """The round kind a row of the table measures (its wire name): "seeded_curvature" -> "seeded",
    "eval_mixture" -> "eval" (anytime candidates are eval rounds over weight mixtures), else the row itself."""
    return {"eval_mixture": "eval"}.get(row, row.removesuffix("_curvature"))


def precisions(res: dict) -> dict[str, str]:
    """{kind: "bf16" if every row of the kind has bf16 SNR >= res["snr_bound"] else "tf32"} of a `measure` result."""
    out: dict[str, str] = {}
    for row, r in res["rows"].items():
        k = kind_of_row(row)
        ok = r["bf16"]["snr"] >= res["snr_bound"]
        out[k] = "bf16" if ok and out.get(k, "bf16") == "bf16" else "tf32"
    return out


def table(res: dict) -> str:
    """The markdown table of a `measure` result: kind, rms signal, TF32 SNR, bf16 SNR, the declared precision."""
    lines = ["| kind | rms signal (nats) | TF32 SNR | TF32 + bf16 attention SNR | bf16 SNR | bf16 clears the bound? |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k, r in res["rows"].items():
        ok = "yes" if r["bf16"]["snr"] >= res["snr_bound"] else "no"
        mid = r.get("tf32_bf16attn", {}).get("snr", float("nan"))
        lines.append(f"| {k} | {r['tf32']['rms_signal']:.3g} | {r['tf32']['snr']:.3g} | {mid:.3g} | {r['bf16']['snr']:.3g} | {ok} |")
    return "\n".join(lines)
