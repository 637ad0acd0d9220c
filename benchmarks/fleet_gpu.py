"""The GPU parts of `sparecycles bench fleet`: publish -> ready from a trainer on a GPU, the training
loop's cost per published version, and the worker's losses against in-process evaluation on the same GPU.

- `publish_ready`: a model on the trainer's device published as new versions (weights scaled by 1 + 1e-3 v
  before each, so no shard is already cached anywhere), synchronously or in the background
  (`BackendTuning(background=True)`): the publish call's wall, the wall until its uploads finished, and
  the wall until every worker's heartbeat reports the version loaded (seconds).
- `trainer_cost`: `interval` training steps (trainer.zo.modes.backprop_step, AdamW, the trainer's precision)
  without publishing and with zocurv-line's two publishes per interval (the steps before and at a refresh),
  alternated `repeats` times; cost per version = (with - without) / 2, against the interval's wall.
- `compare_losses`: a timed round's results from the worker against `InProcessBackend` (the trainer's in-process
  probes: per-unit evaluator, eager) and against `probe_kernels.WholeModelEvaluator` (the worker's fast path, compiled
  here in this process) on the same seeds, weights and device: max |dL| and how many values are bit-equal.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from probe_kernels import WholeModelEvaluator


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bump(model: torch.nn.Module, version: int) -> None:
    """Make `version`'s weights differ from every other's (scale by 1 + 1e-3 * version, deterministic)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 1e-3 * version)


def publish_ready(fleet, names: list[str], backend, model: torch.nn.Module, versions: list[int]) -> list[dict]:
    """Publish each of `versions` through `backend` and wait for every worker in `names` to hold it.

    Returns one dict per version: call_s (the publish call), uploaded_s (its uploads done; = call_s when
    synchronous), ready_s (every worker reports it loaded), all from the start of the call, plus the backend's
    `publish_timings` of the version (serialise_s, upload_s, register_s, bytes) when it keeps them."""
    device = next(model.parameters()).device
    out = []
    for v in versions:
        _bump(model, v)
        _sync(device)
        t0 = time.perf_counter()
        backend.publish(v)
        call = time.perf_counter() - t0
        backend.flush() if hasattr(backend, "flush") else None
        uploaded = time.perf_counter() - t0
        fleet.wait(lambda v=v: all(fleet.info(nm)["version"] == v for nm in names), f"version {v} on every worker")
        ready = time.perf_counter() - t0
        out.append({"version": v, "call_s": call, "uploaded_s": uploaded, "ready_s": ready,
                    **(backend.publisher.publish_timings.get(v, {}) if hasattr(backend, "publisher") else {})})
    return out


def trainer_cost(backend, model: torch.nn.Module, batch, loss_fn: Callable, interval: int = 20, repeats: int = 3,
                 first_version: int = 100) -> dict:
    """Wall time of `interval` training steps without and with two publishes (see the module docstring).

    One untimed interval first, then `repeats` pairs (without, with). Returns {"interval_s": [...],
    "interval_with_publish_s": [...], "cost_per_version_s" (median over pairs of (with - without) / 2),
    "cost_fraction" (that / the median interval_s), "publish_call_s": [...]}."""
    from trainer.zo.modes import backprop_step

    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for _ in range(interval):
        backprop_step(model, opt, loss_fn, batch, 1.0)
    _sync(device)
    plain, with_pub, calls = [], [], []
    v = first_version
    for _ in range(repeats):
        for publish in (False, True):
            t0 = time.perf_counter()
            for i in range(interval):
                if publish and i in (0, interval - 1):  # zocurv-line: the versions around a refresh
                    t1 = time.perf_counter()
                    backend.publish(v)
                    calls.append(time.perf_counter() - t1)
                    v += 1
                backprop_step(model, opt, loss_fn, batch, 1.0)
            _sync(device)
            (with_pub if publish else plain).append(time.perf_counter() - t0)
        backend.flush() if hasattr(backend, "flush") else None  # the next pair starts with nothing in flight
    model.eval()
    med = sorted(plain)[len(plain) // 2]
    diffs = sorted((w - p) / 2 for w, p in zip(with_pub, plain))
    cost = diffs[len(diffs) // 2]
    return {"interval_steps": interval, "interval_s": plain, "interval_with_publish_s": with_pub,
            "cost_per_version_s": cost, "cost_fraction": cost / med, "publish_call_s": calls}


def _diff(worker: list[float], ref: list[float]) -> dict:
    d = [abs(a - b) for a, b in zip(worker, ref)]
    return {"values": len(d), "bit_equal": sum(a == b for a, b in zip(worker, ref)), "max_abs": max(d),
            "max_rel": max(x / abs(b) for x, b in zip(d, ref))}


def compare_losses(results, model: torch.nn.Module, batch, loss_fn: Callable, eps: float, dist: str,
                   device: str, seeds: int = 16, compiled: bool = True) -> dict:
    """The worker's (l_plus, l_minus) of `results` (SeedResult of one seeded round on `model`'s published
    weights) against the same seeds evaluated here on `device` (see the module docstring)."""
    from trainer.zo.backend import InProcessBackend
    from trainer.zo.probes import RoundSpec

    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")  # as probe_worker.cli and the trainer on CUDA
    picked = sorted(results, key=lambda r: r.seed)[:seeds]
    worker = [x for r in picked for x in (r.l_plus, r.l_minus)]
    here = copy.deepcopy(model).to(device).eval()
    b = tuple(t.to(device) for t in batch)
    ref = InProcessBackend(here, loss_fn)
    ref.submit(RoundSpec("compare", 0, b, eps, tuple(r.seed for r in picked), dist))
    got = {r.seed: r for r in ref.collect("compare").results}
    out = {"seeds": len(picked), "device": device, "eps": eps, "distribution": dist,
           "in_process_reference": _diff(worker, [x for r in picked for x in (got[r.seed].l_plus, got[r.seed].l_minus)])}
    if compiled:
        fast = WholeModelEvaluator(here, loss_fn, compile=torch.device(device).type == "cuda")
        vals = fast.losses(b, [r.seed for r in picked], eps, dist)
        out["in_process_fast_path"] = {**_diff(worker, [x for pair in vals for x in pair]), "compiled": fast.compiled}
        fast.close()
    return out
