"""`sparecycles bench segments`: what bounding a worker's queued device work costs, and how fast a cut lands.

Beside a serving engine a worker's forward is segmented (probe_kernels.FastForward(segmented=True): each transformer
block compiled on its own) and its task waits for the device before each block (probe_worker.preemption.Preemption),
so that at most one block's kernels are queued when the engine needs the device. Against the usual whole-model
compile on the same model, batch and device this measures, side by side in one process:

- throughput: forwards per second with the engine idle (nothing fired), whole vs segmented (median of `repeats`
  timings of `iters` forwards each, after a warm-up that compiles);
- the cut: `cuts` times, a thread fires the guard at a uniformly drawn moment of a forward (seeded draws) and the
  task thread measures from the fire to the device being idle again (the forward stopped and its queued work
  done): for the whole-model compile that is the rest of the forward, for the segmented one at most one block.

Figures in seconds; p50/p95 over the cuts.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.options import ModelPreset


class SegmentsBench(BaseModel):
    """`bench segments`'s settings (each field one option of the command)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: ModelPreset = Field("gpt2-medium", description="model preset (a GPT-2 shape, seeded weights)")
    batch_size: int = Field(16, ge=1, le=1024, description="rows per forward")
    seq_len: int = Field(512, ge=2, le=4096, description="tokens per row")
    device: str = Field("cuda:0", pattern=r"^(cpu|cuda(:\d+)?)$", description="torch device")
    dtype: str = Field("bfloat16", pattern=r"^(float32|bfloat16)$", description="the copy's dtype")
    iters: int = Field(20, ge=1, le=10_000, description="forwards per throughput timing")
    repeats: int = Field(5, ge=1, le=100, description="throughput timings per arm (the median is reported)")
    cuts: int = Field(40, ge=1, le=10_000, description="fired forwards per arm")
    seed: int = Field(0, description="seed of the batch and of the fire moments")
    json_out: Path | None = Field(None, description="write the result JSON here")


def _percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731 - nearest rank
    return {"n": len(xs), "p50": at(0.5), "p95": at(0.95), "max": xs[-1]}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _throughput(ff, batch, o: SegmentsBench, device) -> float:
    """Median forwards per second over `o.repeats` timings of `o.iters` forwards."""
    rates = []
    for _ in range(o.repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(o.iters):
            ff(batch)
        _sync(device)
        rates.append(o.iters / (time.perf_counter() - t0))
    return statistics.median(rates)


def _cut_latencies(ff, batch, guard, forward_s: float, o: SegmentsBench, device) -> tuple[list[float], int]:
    """Seconds from each fire to the device idle again, and how many forwards the fire stopped (Preempted)."""
    from probe_worker.preemption import Preempted

    draw = random.Random(o.seed)
    out, stopped = [], 0
    for _ in range(o.cuts):
        fired_at: list[float] = []
        delay = draw.uniform(0.0, forward_s)
        timer = threading.Timer(delay, lambda at=fired_at: (at.append(time.perf_counter()), guard.fire()))
        _sync(device)
        guard.arm()
        timer.start()
        try:
            ff(batch)
        except Preempted:
            stopped += 1
        _sync(device)
        end = time.perf_counter()
        timer.join()
        guard.disarm()
        if fired_at and fired_at[0] <= end:
            out.append(end - fired_at[0])
    return out, stopped


def measure(o: SegmentsBench, progress=print) -> dict:
    """Both arms on one model and batch; returns the result dict (see the module docstring)."""
    import torch

    from probe_kernels.compiled_forward import FastForward
    from probe_worker.preemption import Preemption
    from trainer.models.causal_lm import build_causal_lm
    from trainer.models.losses import lm_batch_loss

    device = torch.device(o.device)
    model, info = build_causal_lm(o.preset, seed=o.seed, device=device)
    g = torch.Generator().manual_seed(o.seed)
    tokens = torch.randint(0, info.vocab_size, (o.batch_size, o.seq_len + 1), generator=g).to(device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    dtype = getattr(torch, o.dtype)
    res = {"settings": o.model_dump(mode="json"), "device_name": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "torch": torch.__version__, "arms": {}}
    for arm, segmented in (("whole", False), ("segmented", True)):
        ff = FastForward(model, lm_batch_loss, dtype=dtype, compile=device.type == "cuda", segmented=segmented)
        guard = Preemption()
        handle = guard.install() if segmented else None  # the worker installs it only beside an engine
        with torch.no_grad():
            ff(batch)
            ff(batch)  # compiled, warmed
            guard.arm()  # a task runs: the segmented forward waits for the device before each block
            rate = _throughput(ff, batch, o, device)
            guard.disarm()
            progress(f"{arm}: {rate:.2f} forwards/s")
            if handle is None:
                handle = guard.install()  # the whole compile cannot stop inside: the fire lands after its end
            cuts, stopped = _cut_latencies(ff, batch, guard, 1.0 / rate, o, device)
        handle.remove()
        res["arms"][arm] = {"forwards_per_s": rate, "forward_s": 1.0 / rate, "segments": ff.segments,
                            "cut_to_idle_s": _percentiles(cuts), "cuts_stopped_inside": stopped}
        progress(f"{arm}: fire -> device idle p50 {res['arms'][arm]['cut_to_idle_s']['p50'] * 1e3:.2f} ms, "
                 f"p95 {res['arms'][arm]['cut_to_idle_s']['p95'] * 1e3:.2f} ms; {stopped}/{o.cuts} stopped inside")
        ff.close()
    whole, seg = res["arms"]["whole"], res["arms"]["segmented"]
    res["throughput_ratio"] = seg["forwards_per_s"] / whole["forwards_per_s"]
    res["cut_p95_ratio"] = seg["cut_to_idle_s"]["p95"] / whole["cut_to_idle_s"]["p95"]
    return res


def table(res: dict) -> str:
    """A short text table of `measure`'s result."""
    rows = [f"{'arm':<10} {'fwd/s':>8} {'fwd ms':>8} {'cut p50 ms':>11} {'cut p95 ms':>11} {'stopped':>8}"]
    for arm, a in res["arms"].items():
        rows.append(f"{arm:<10} {a['forwards_per_s']:8.2f} {a['forward_s'] * 1e3:8.2f} "
                    f"{a['cut_to_idle_s']['p50'] * 1e3:11.2f} {a['cut_to_idle_s']['p95'] * 1e3:11.2f} "
                    f"{a['cuts_stopped_inside']:>8}")
    rows.append(f"segmented / whole: throughput {res['throughput_ratio']:.3f}x, cut p95 {res['cut_p95_ratio']:.3f}x "
                f"({res['device_name']})")
    return "\n".join(rows)
