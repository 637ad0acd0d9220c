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
        devs = tuple(_check(d.strip(), n_cuda, "--worker-devices") for d in worker_devices.split(",") if d.strip())
        if not devs:
            raise ValueError("--worker-devices: give at least one device, e.g. cuda:1,cuda:2")
        shared = sorted(set(devs) & {trainer} - {"cpu"})
        note = f"the trainer shares {', '.join(shared)} with a probe worker" if shared else ""
        return Placement(trainer, devs, note)
    return Placement(trainer, ("cpu",) * workers)


def place_here(*, device: str | None = None, worker_devices: str | None = None, gpus: str | None = None,
               workers: int = 1) -> Placement:
    """`place` with the number of CUDA devices torch sees on this machine; torch is imported (and CUDA asked)
    only when an option names a GPU. Raises ValueError as `place` does."""
    n_cuda = 0
    if gpus is not None or any(x is not None and "cuda" in x for x in (device, worker_devices)):
        import torch

        n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return place(device=device, worker_devices=worker_devices, gpus=gpus, workers=workers, n_cuda=n_cuda)
