"""The anytime-model benchmark (issue 31): served vs raw vs runs annealed early, in one process on one GPU.

Protocol: gpt2-small, B×T = 16×1024, AdamW (β 0.9/0.95, wd 0.1 on matrices, clip 1.0) with warmup-stable-decay
(linear warmup over `warmup` steps, constant `lr`, linear decay to 0 over the last `decay_frac` of the run;
Hägele et al. NeurIPS 2024), on classics-large (under one epoch). Every `eval_every` steps: the raw validation
loss, and the anytime model (trainer.anytime: the last k versions published every `publish_every` steps;
candidates raw, EMAs, uniform averages and the quadratic fit's minimiser, scored on `select_batches` batches of
the *selection* split) with its served validation loss on the same validation windows. The references are
AdamW runs of length f·T for f in `ref_fracs` with their own WSD schedule: they share the main run's stable
phase (same batches), so each branches from the main run at step 0.8·f·T (a copy of weights and optimizer
state) and decays to f·T. Candidates are scored in this process on the trainer's GPU (trainer.anytime.serve
.InProcessScorer), not on a fleet: one H200, one call.

Anytime speedup at an evaluation (step s, served loss L): the step at which the main run's raw validation loss
first reaches L (linear interpolation between evaluations), divided by s; `None` when raw never does (then
`speedup_lower_bound` = T / s). With `--pull` (ablation) the main run moves to the served weights when they beat raw by > 3 paired
standard errors on the selection batches (optimizer state kept); its final raw loss is then compared with the
plain WSD run's at the same step. Usage: `python -m experiments.anytime.bench --out DIR [--steps 1500] [--device cuda]`
(CPU dry run: `--preset gpt2-tiny --corpus ... --steps 40 --batch-size 2 --seq-len 32 --device cpu`); then
`python -m experiments.anytime.report DIR/anytime.json --out experiments/anytime/results`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def wsd_lr(step: int, *, lr: float, warmup: int, total: int, decay_frac: float) -> float:
    """Warmup-stable-decay at 0-based `step`: linear warmup to `lr` over `warmup` steps, constant, then linear
    decay to 0 over the last `decay_frac` of `total` (the lr of the step's update; step total-1 gets
    lr / decay_steps). Pure function."""
    decay_start = total - max(1, round(decay_frac * total))
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < decay_start:
        return lr
    return lr * (total - step) / (total - decay_start)


def speedup(raw: list[tuple[int, float]], step: int, loss: float) -> float | None:
    """(step at which the raw curve first reaches `loss`) / `step`, the crossing linearly interpolated between
    the two evaluations around it; None when it never does. `raw`: (step, val loss) in step order."""
    prev = None
    for s, v in raw:
        if v <= loss:
            if prev is None or prev[1] == v:
                return s / step
            s0, v0 = prev
            return (s0 + (v0 - loss) / (v0 - v) * (s - s0)) / step
        prev = (s, v)
    return None


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--corpus", default="classics-large")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=0, help="default: 5%% of steps")
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--eval-every", type=int, default=0, help="default: steps / 20")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--ref-fracs", default="0.25,0.5,0.75")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--publish-every", type=int, default=0, help="default: steps / 50")
    p.add_argument("--select-batches", type=int, default=8)
    p.add_argument("--quad-dim", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=480.0, help="stop and write what ran after this long")
    p.add_argument("--pull", action="store_true", help="the --pull ablation: the main run moves to the served "
                   "model when it beats raw by > 3 SE on the selection split (give --ref-fracs '' with it)")
    p.add_argument("--name", default="anytime", help="output file stem (NAME.json, NAME.png)")
    return p.parse_args(argv)


@dataclass
class _Bench:
    """The benchmark's fixed parts: the arguments, the corpus, the loss (bf16 autocast on CUDA with --bf16), the
    held-out batches on the device and the counts derived from --steps."""

    a: argparse.Namespace
    corpus: Any
    loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    val: list[tuple[torch.Tensor, torch.Tensor]]
    warmup: int
    eval_every: int
    publish_every: int
    fracs: list[float]

    @torch.no_grad()
    def evaluate(self, m: torch.nn.Module) -> dict[str, float]:
        """{"val_loss": mean loss over the held-out batches}, in eval mode (the model's mode restored)."""
        was = m.training
        m.eval()
        out = sum(float(self.loss_fn(m, x, y)) for x, y in self.val) / len(self.val)
        m.train(was)
        return {"val_loss": out}

    def adamw(self, m: torch.nn.Module) -> torch.optim.AdamW:
        """AdamW of the protocol: β (0.9, 0.95), weight decay 0.1 on matrices only, fused on CUDA."""
        a = self.a
        return torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=a.lr, betas=(0.9, 0.95), fused=a.device.startswith("cuda"))

    def train_step(self, m: torch.nn.Module, o: torch.optim.Optimizer, step: int, total: int) -> float:
        """One AdamW step at 0-based `step` of a `total`-step WSD schedule (clip 1.0); returns the step's lr."""
        from trainer.data import get_batch

        a = self.a
        lr = wsd_lr(step, lr=a.lr, warmup=self.warmup, total=total, decay_frac=a.decay_frac)
        for g in o.param_groups:
            g["lr"] = lr
        x, y = get_batch(self.corpus.train, a.batch_size, a.seq_len, a.seed, step)
        o.zero_grad(set_to_none=True)
        loss = self.loss_fn(m, x.to(a.device), y.to(a.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        return lr


def _setup(a: argparse.Namespace) -> _Bench:
    """TF32 on CUDA, the corpus (a warning when the run reads more than one epoch), the loss and held-out batches."""
    from trainer.data import iter_eval_batches, load_corpus
    from trainer.models.losses import lm_loss

    T = a.steps
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    corpus = load_corpus(a.corpus)
    if corpus.train.size < T * a.batch_size * a.seq_len:
        print(f"warning: {T} steps read {T * a.batch_size * a.seq_len:,} tokens, more than the "
              f"{corpus.train.size:,} of one epoch")
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if a.bf16 and a.device.startswith("cuda")
           else contextlib.nullcontext())

    def loss_fn(m, x, y):
        with amp:
            return lm_loss(m, x, y)

    val = [(x.to(a.device), y.to(a.device)) for x, y in
           iter_eval_batches(corpus.val, a.batch_size, a.seq_len, a.eval_batches)]
    return _Bench(a, corpus, loss_fn, val, warmup=a.warmup or max(1, T // 20),
                  eval_every=a.eval_every or max(1, T // 20), publish_every=a.publish_every or max(1, T // 50),
                  fracs=[float(f) for f in a.ref_fracs.split(",") if f])


def _eval_point(b: _Bench, anytime, model: torch.nn.Module, done: int, lr: float,
                timing: dict[str, float]) -> dict[str, Any]:
    """The record of an evaluation after `done` steps: raw validation loss, the served model's (Anytime.evaluate)
    and the selection's losses per candidate; their seconds added to `timing`; printed as a JSON line."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"step": done, "lr": lr, "raw_val": b.evaluate(model)["val_loss"]}
    timing["eval_raw_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    served = anytime.evaluate(done, model, b.evaluate)
    timing["anytime_s"] += time.perf_counter() - t0
    sel = anytime.last
    rec.update(served_val=served["served_val_loss"], **{k: v for k, v in served.items()
                                                       if k != "served_val_loss"})
    rec["sel_losses"] = {s.name: s.mean for s in sel.scored} if sel else {}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                      if k not in ("sel_losses", "served_coefs")}), flush=True)
    return rec


def _main_run(b: _Bench, model: torch.nn.Module, opt: torch.optim.Optimizer, anytime, branch_at: dict[float, int],
              t_start: float, timing: dict[str, float]):
    """The main WSD run of T steps, publishing to `anytime` after every step and evaluating every eval_every;
    snapshots (model, optimizer state) at each reference's branch step. Stops when 70% of the deadline is spent
    (the rest is the references'). Returns (evals, snapshots {frac: (model state, optimizer state)}, the step it
    stopped at or None)."""
    a, T = b.a, b.a.steps
    snapshots: dict[float, tuple[dict, dict]] = {}
    evals: list[dict[str, Any]] = [{"step": 0, "raw_val": b.evaluate(model)["val_loss"]}]
    stopped = None
    for step in range(T):
        for f, at in branch_at.items():
            if step == at:
                snapshots[f] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        t0 = time.perf_counter()
        lr = b.train_step(model, opt, step, T)
        done = step + 1
        anytime.publish(done, model)
        timing["train_s"] += time.perf_counter() - t0
        if done % b.eval_every == 0 or done == T:
            evals.append(_eval_point(b, anytime, model, done, lr, timing))
        if time.perf_counter() - t_start > a.deadline_s * (T - 0.3 * T) / T:
            stopped = done
            print(f"deadline: main run stopped at step {done}", flush=True)
            break
    return evals, snapshots, stopped


def _references(b: _Bench, model: torch.nn.Module, snapshots: dict[float, tuple[dict, dict]],
                branch_at: dict[float, int], t_start: float) -> list[dict[str, Any]]:
    """Each reference run of f·T steps: from the main run's snapshot at its branch step, its own WSD decay to the
    end; skipped without a snapshot or past the deadline. Returns [{"frac", "steps", "decay_start", "val"}]."""
    refs = []
    for f in b.fracs:
        if f not in snapshots or time.perf_counter() - t_start > b.a.deadline_s:
            continue
        total = int(round(f * b.a.steps))
        m = copy.deepcopy(model)
        m.load_state_dict(snapshots[f][0])
        o = b.adamw(m)
        o.load_state_dict(snapshots[f][1])
        for step in range(branch_at[f], total):
            b.train_step(m, o, step, total)
        refs.append({"frac": f, "steps": total, "decay_start": branch_at[f], "val": b.evaluate(m)["val_loss"]})
        print(json.dumps(refs[-1]), flush=True)
        del m, o
    return refs


def _add_speedups(evals: list[dict[str, Any]], stopped: int | None, steps: int) -> None:
    """Each served evaluation's anytime speedup against the raw curve (`speedup`), or, when raw never reaches
    it, the lower bound (last raw step) / step."""
    raw_curve = [(e["step"], e["raw_val"]) for e in evals]
    for e in evals:
        if "served_val" in e:
            e["speedup"] = speedup(raw_curve, e["step"], e["served_val"])
            e["speedup_lower_bound"] = None if e["speedup"] is not None else (stopped or steps) / e["step"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and write OUT/anytime.json and OUT/anytime.png; returns the JSON dict."""
    from trainer.anytime.serve import Anytime
    from trainer.anytime.settings import AnytimeSettings
    from trainer.models import build_model

    a = _args(argv)
    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    T = a.steps
    b = _setup(a)
    model = build_model(a.preset, seed=a.seed, device=a.device)
    opt = b.adamw(model)
    settings = AnytimeSettings(k=a.k, publish_every=b.publish_every, select_batches=a.select_batches,
                               quad_dim=a.quad_dim, windows=tuple(m for m in (2, 4, 8, 16) if m <= a.k),
                               pull=a.pull)
    anytime = Anytime(settings, b.corpus.select, batch_size=a.batch_size, seq_len=a.seq_len, device=a.device,
                      run_path=a.out, loss=b.loss_fn)
    branch_at = {f: int(round(f * T)) - max(1, round(a.decay_frac * round(f * T))) for f in b.fracs}
    timing = {"train_s": 0.0, "eval_raw_s": 0.0, "anytime_s": 0.0, "refs_s": 0.0}
    evals, snapshots, stopped = _main_run(b, model, opt, anytime, branch_at, t_start, timing)
    t0 = time.perf_counter()
    refs = _references(b, model, snapshots, branch_at, t_start)
    timing["refs_s"] = time.perf_counter() - t0
    _add_speedups(evals, stopped, T)
    corpus = b.corpus
    result = {
        "benchmark": "anytime", "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "warmup": b.warmup,
                     "eval_every": b.eval_every, "publish_every": b.publish_every,
                     "anytime": settings.model_dump()},
        "corpus_tokens": {"train": int(corpus.train.size), "val": int(corpus.val.size),
                          "select": int(corpus.select.size)},
        "scoring": f"in the trainer process on its device ({a.device}; InProcessScorer)",
        "evals": evals, "references": refs, "stopped_at": stopped, "timing_s": timing,
        "wall_s": time.perf_counter() - t_start,
    }
    (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=2))
    from experiments.anytime.report import plot

    plot(result, a.out / f"{a.name}.png")
    return result


if __name__ == "__main__":
    main()
