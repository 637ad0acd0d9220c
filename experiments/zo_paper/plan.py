"""Planning `python -m experiments.zo --regime paper` over several device calls (issue 18): which arms run, their shares of
the call's time budget, each arm's fp32 matmul precision, and merging an earlier call's paper_summary.json.

Pure functions of their arguments (no I/O), used by experiments.zo_paper.paper.paper_comparison and the CLI.
"""

from __future__ import annotations

from typing import Any

from experiments.zo_paper.steps import PAPER

MATMUL_MODES = ("highest", "high")  # torch.set_float32_matmul_precision: true fp32, or TF32


def paper_arms(total_s: float, names: tuple[str, ...] | None = None, mezo_lrs=(1e-5, 3e-5),
               adamw_lrs=(1e-5, 5e-5), weights: dict[str, float] | None = None) -> list[dict]:
    """The arms A1..A6 (all, or those in `names`, in the canonical order) with iteration caps, "share" (the
    fraction of `total_s` seconds) and "time_s" = share · total_s. Weights: A1 24, A2 16, A3 and A3w 11 each,
    A4-16 5, A4-128 8, MeZO 5 and AdamW 3 per lr (91 in all), renormalised over the arms chosen (the shares
    sum to 1); `weights` {arm: weight > 0} replaces some (parse_weights). A3w's lr is filled in from A1's mean
    w when it runs (`lr_from`). A1, A3 and A3w keep their step ledger ("keeps_ledger": the drift, resuming).
    Raises ValueError for an unknown arm name (in `names` or `weights`) or an empty selection."""
    zo = {"method": "1.5spsa", "numerics": "master", "lr": PAPER.lr, "eps": PAPER.eps, "batch_size": PAPER.batch_size,
          "probes": PAPER.probes, "max_iters": 75, "eval_every": 3, "patience": PAPER.patience}
    # A2 (bf16) steps on one padded batch: on the H200 a bucketed bf16 forward of batch 0 took 0.130 s against
    # 0.055 s padded (fp32: 0.154 vs 0.212 s; experiments/zo_paper/results/fp32/forward_timing.json)
    arms = [dict(zo, name="A1", share=0.24, keeps_ledger=True),
            dict(zo, name="A2", numerics="inplace", share=0.16, max_chunks=1),
            dict(zo, name="A3", method="1spsa", share=0.11, keeps_ledger=True),
            dict(zo, name="A3w", method="1spsa", lr_from="A1 mean w", share=0.11, keeps_ledger=True),
            dict(zo, name="A4-16", batch_size=16, max_iters=2000, eval_every=25, share=0.05),
            dict(zo, name="A4-128", batch_size=128, max_iters=300, eval_every=6, share=0.08)]
    arms += [dict(zo, name=f"A5-{lr:g}", method="mezo", lr=lr, eps=1e-3, batch_size=16, max_iters=20000,
                  eval_every=250, share=0.05) for lr in mezo_lrs]
    arms += [{"name": f"A6-{lr:g}", "kind": "backprop", "lr": lr, "batch_size": 16, "max_iters": 1000,
              "eval_every": 50, "share": 0.03} for lr in adamw_lrs]
    known = [a["name"] for a in arms]
    bad_w = [n for n in (weights or {}) if n not in known]
    if bad_w:
        raise ValueError(f"arms are {', '.join(known)}; weights name {bad_w}")
    arms = [dict(a, share=(weights or {}).get(a["name"], a["share"])) for a in arms]
    if names is not None:
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise ValueError(f"arms are {', '.join(known)}; got {list(names)}")
        arms = [a for a in arms if a["name"] in names]
    total = sum(a["share"] for a in arms)
    return [dict(a, share=a["share"] / total, time_s=total_s * a["share"] / total) for a in arms]


def arm_seconds(share: float, shares_left: float, seconds_left: float) -> float:
    """An arm's seconds when it starts: what is left of the call's budget times its share of the shares of
    the arms not yet run (itself included), so an arm that ran short or long moves the rest, and the last arm
    gets exactly what is left. Never negative. Raises ValueError for shares_left < share or share <= 0."""
    if not 0 < share <= shares_left + 1e-12:
        raise ValueError(f"need 0 < share <= shares_left, got {share}, {shares_left}")
    return max(0.0, seconds_left) * min(1.0, share / shares_left)


def parse_matmul(spec: str, names: list[str]) -> dict[str, str]:
    """{arm: "highest" | "high"} for every arm in `names` from a spec such as "highest", "high" or
    "high,A1=highest,A3=highest": a bare mode is the default (at most one; "highest" if none), ARM=mode sets
    one arm (an arm of `names` or not: a spec can name arms that another call runs).
    Raises ValueError for an unknown mode, two defaults or a malformed entry."""
    default, per = None, {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        arm, _, mode = part.rpartition("=")
        if mode not in MATMUL_MODES or (arm == "" and "=" in part):
            raise ValueError(f"fp32 matmul entries are highest, high or ARM=highest|high; got {part!r}")
        if not arm:
            if default is not None:
                raise ValueError(f"two default fp32 matmul modes in {spec!r}")
            default = mode
        else:
            per[arm] = mode
    return {n: per.get(n, default or "highest") for n in names}


def parse_weights(spec: str) -> dict[str, float]:
    """{arm: weight} from "A1=70,A3=24" (weights > 0, any scale: paper_arms renormalises). Empty spec: {}.
    Raises ValueError for a malformed entry or a weight that is not a positive finite number."""
    out = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        arm, _, w = part.partition("=")
        try:
            v = float(w)
        except ValueError:
            v = float("nan")
        if not arm or not 0 < v < float("inf"):
            raise ValueError(f"share weights are ARM=positive number, got {part!r}")
        out[arm.strip()] = v
    return out


def a1_mean_w(results: dict[str, Any]) -> float | None:
    """Mean of A1's per-iteration mean w (1.5-SPSA's weights) in `results` (run now or included); None when
    A1 is absent or logged no w."""
    ws = [r["w_mean"] for r in results.get("A1", {}).get("log", []) if "w_mean" in r]
    return sum(ws) / len(ws) if ws else None


def check_plan(names: list[str], include: dict[str, Any] | None) -> None:
    """Raises ValueError when A3w is asked for without A1 run now or in the included summary."""
    if "A3w" in names and "A1" not in names and "A1" not in (include or {}).get("arms", {}):
        raise ValueError("A3w takes its lr from A1's mean w: run A1 too, or include a summary that has A1")


def merge_include(include: dict[str, Any] | None, names_now: list[str], resume: bool = False) -> dict[str, Any]:
    """What an earlier call's summary contributes to this one: {"arms": its arms not run now, "ledgers": its
    step ledgers {arm: [[seeds, coeffs, eps], ...]} of the arms not restarted now, "resume": {arm: its result
    with "ledger"} for the arms run now that stopped on time and can continue (only with `resume`), "drift":
    its drift unless A1 runs now (the drift is measured on A1's ledger), "calls": its calls}. An arm run now
    that already finished in the include (stop "max_iters" or "diverged") is kept as it is, not re-run (it is
    in "arms" and in "done"). Without `resume`, an arm run now restarts from scratch."""
    inc = include or {}
    old_arms, old_ledgers = inc.get("arms", {}), dict(inc.get("ledgers", {}))
    if "ledger_A1" in inc and "A1" not in old_ledgers:
        old_ledgers["A1"] = inc["ledger_A1"]
    cont, done = {}, []
    for n in names_now:
        r = old_arms.get(n)
        if resume and r is not None and n in old_ledgers:
            if r.get("stop") == "time":
                cont[n] = dict(r, ledger=old_ledgers[n])
            else:
                done.append(n)
    restart = set(names_now) - set(done) - set(cont)
    return {"arms": {n: r for n, r in old_arms.items() if n not in restart and n not in cont},
            "ledgers": {n: led for n, led in old_ledgers.items() if n not in restart},
            "resume": cont, "done": done,
            "drift": None if "A1" in names_now and "A1" not in done else inc.get("drift"),
            "calls": list(inc.get("meta", {}).get("calls", []))}


def canonical_order(names: list[str]) -> list[str]:
    """`names` sorted as paper_arms lists them (unknown names last, in their order)."""
    known = [a["name"] for a in paper_arms(1.0)]
    return sorted(names, key=lambda n: (known.index(n) if n in known else len(known), names.index(n)))
