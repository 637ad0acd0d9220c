"""Where `sparecycles up` puts the trainer and its probe workers: `--device`, `--worker-devices`, `--gpus auto`.

Pure: `place(...)` takes the number of visible CUDA devices as an argument (the caller asks torch), so every
rule is testable on a machine without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Placement:
    """trainer: the trainer's torch device; workers: one torch device per probe worker process; note: a line
    for the user when the placement is not the obvious one (e.g. one GPU shared), else ""."""

    trainer: str
    workers: tuple[str, ...]
    note: str = ""


def _check(dev: str, n_cuda: int, option: str) -> str:
    if not _DEVICE.match(dev):
        raise ValueError(f"{option}: {dev!r} is not a torch device (cpu, cuda or cuda:N)")
    if dev.startswith("cuda"):
        if n_cuda == 0:
            raise ValueError(f"{option} {dev}: no CUDA device is visible here (torch.cuda.device_count() is 0); "
                             "run on a GPU host or leave the option out to use the CPU")
        index = int(dev.split(":")[1]) if ":" in dev else 0
        if index >= n_cuda:
            raise ValueError(f"{option} {dev}: only {n_cuda} CUDA device(s) are visible (cuda:0..cuda:{n_cuda - 1})")
        return f"cuda:{index}"
    return dev


def place(*, device: str | None, worker_devices: str | None, gpus: str | None, workers: int, n_cuda: int) -> Placement:
    """Decide the trainer's and the workers' devices.

    - `gpus="auto"`: the trainer on cuda:0 and one worker per remaining GPU; with one GPU the trainer and one
      worker share it (said in `note`). Excludes `device` and `worker_devices`.
    - `worker_devices="cuda:1,cuda:2"`: one worker per entry (their number replaces `workers`).
    - otherwise `workers` workers on the CPU; the trainer on `device` (default cpu).
    Raises ValueError (naming the option) for a malformed device, CUDA asked for where none is visible, an
    index past the visible devices, or conflicting options.
    """
    if gpus is not None:
        if gpus != "auto":
            raise ValueError(f"--gpus takes 'auto' (trainer on the first GPU, a worker on each other), got {gpus!r}")
        if device is not None or worker_devices is not None:
            raise ValueError("--gpus auto places everything itself: leave out --device and --worker-devices")
        if n_cuda == 0:
            raise ValueError("--gpus auto: no CUDA device is visible here (torch.cuda.device_count() is 0)")
        if n_cuda == 1:
            return Placement("cuda:0", ("cuda:0",), "one GPU: the trainer and its one probe worker share cuda:0")
        return Placement("cuda:0", tuple(f"cuda:{i}" for i in range(1, n_cuda)))
    trainer = _check(device or "cpu", n_cuda, "--device")
    if worker_devices is not None:
        devs = device_list(worker_devices, n_cuda, "--worker-devices")
        shared = sorted(set(devs) & {trainer} - {"cpu"})
        note = f"the trainer shares {', '.join(shared)} with a probe worker" if shared else ""
        return Placement(trainer, devs, note)
    return Placement(trainer, ("cpu",) * workers)


def check_worker_count(workers: int | None, worker_devices: str | None) -> None:
    """`--workers` given beside `--worker-devices` (which starts one worker per device and replaces it) must name
    the same count. Raises ValueError naming both when they disagree; `workers` None: not given."""
    if workers is None or worker_devices is None:
        return
    n = len([d for d in worker_devices.split(",") if d.strip()])
    if n != workers:
        raise ValueError(f"--workers {workers} and --worker-devices {worker_devices} ({n} devices) disagree: "
                         "--worker-devices starts one worker per device and replaces --workers; leave --workers out")


def device_list(text: str, n_cuda: int, option: str) -> tuple[str, ...]:
    """The devices of a comma list ("cuda:1,cuda:2"), each checked as `place` checks one. Raises ValueError naming
    `option` for none given, an empty item ("cpu,,cpu") or a device `_check` refuses."""
    items = [d.strip() for d in text.split(",")]
    if not any(items):
        raise ValueError(f"{option}: give at least one device, e.g. cuda:1,cuda:2")
    if "" in items:
        raise ValueError(f"{option}: {text!r} has an empty item: give comma-separated devices, e.g. cuda:1,cuda:2")
    return tuple(_check(d, n_cuda, option) for d in items)


def cuda_count(*texts: str | None) -> int:
    """The CUDA devices torch sees here when one of `texts` names CUDA (torch imported only then), else 0."""
    if not any(t is not None and "cuda" in t for t in texts):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_here(dev: str, option: str) -> str:
    """One device checked as `place` checks it, with the CUDA devices of this machine ("cuda" -> "cuda:0")."""
    return _check(dev, cuda_count(dev), option)


def devices_here(text: str, option: str) -> tuple[str, ...]:
    """`device_list` with the CUDA devices of this machine: an option's devices checked before anything starts."""
    return device_list(text, cuda_count(text), option)


def place_here(*, device: str | None = None, worker_devices: str | None = None, gpus: str | None = None,
               workers: int = 1) -> Placement:
    """`place` with the number of CUDA devices torch sees on this machine; torch is imported (and CUDA asked)
    only when an option names a GPU. Raises ValueError as `place` does."""
    n_cuda = cuda_count(device, worker_devices, "cuda" if gpus is not None else None)
    return place(device=device, worker_devices=worker_devices, gpus=gpus, workers=workers, n_cuda=n_cuda)
