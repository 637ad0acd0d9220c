"""Checkpoints as safetensors: model parameters, optimizer state and the run position, in one file.

Layout of the file (one safetensors archive, written atomically):
- `model/<canonical parameter name>`: every canonical parameter once (tied weights once);
- `optim/<param index>/<state key>`: every tensor of `optimizer.state_dict()["state"]`;
- `extra/<name>`: caller-supplied tensors (e.g. a ZO curvature state);
- metadata `sparecycles` (JSON): format version, step, config, param-order hash, the optimizer's
  non-tensor state (param groups, scalar state entries) and caller-supplied JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trainer.models.io import read_safetensors_metadata

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, or does not match the model it is loaded into."""


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    meta: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint atomically (tmp file + rename) and return its path.

    Args:
        path: destination `.safetensors` file.
        model: its `named_parameters()` (canonical order, tied weights once) are saved.
        optimizer: any torch optimizer whose state values are tensors or JSON scalars; None for none.
        step: number of optimizer steps completed (the next step to run on resume).
        meta: JSON-serialisable run information (config, data position, counters).
        extra: further tensors to store under `extra/`.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"model/{name}"] = p.detach().to("cpu").contiguous()
    optim_meta: dict[str, Any] = {}
    if optimizer is not None:
        sd = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor):
                    tensors[f"optim/{idx}/{key}"] = val.detach().to("cpu").contiguous()
                else:
                    scalars.setdefault(str(idx), {})[key] = val
        optim_meta = {"param_groups": sd["param_groups"], "scalars": scalars}
    for name, t in (extra or {}).items():
        tensors[f"extra/{name}"] = t.detach().to("cpu").contiguous()
    header = {"format": FORMAT_VERSION, "step": step, "optimizer": optim_meta, "meta": meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={"sparecycles": json.dumps(header)})
    os.replace(tmp, path)
    return path


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint holds (its metadata only, no tensor read), or None when missing or unreadable."""
    try:
        return int(json.loads(read_safetensors_metadata(path)["sparecycles"])["step"])
    except (OSError, KeyError, ValueError, TypeError, SafetensorError):
        return None


def unreadable_message(path: Path, exc: BaseException) -> str:
    """One line naming a checkpoint that cannot be read, why, and what to do."""
    why = " ".join(str(exc).split())[:300] or type(exc).__name__
    return (f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: {why}); rerun with --overwrite "
            "to start the run again, or restore a good copy of the file")


def checkpoint_problem(path: Path) -> str | None:
    """`unreadable_message` for a checkpoint file whose safetensors header or length is bad, else None.

    Reads the header only (safetensors checks that the data section covers every tensor's offsets, so a
    truncated file is caught); a missing file is no problem here (None).
    """
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            json.loads(f.metadata()["sparecycles"])
    except (OSError, KeyError, ValueError, TypeError, SafetensorError) as exc:
        return unreadable_message(path, exc)
    return None


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
    """Load a checkpoint written by `save_checkpoint` into `model` (and `optimizer`) in place.

    Returns:
        (step, meta, extra tensors).

    Raises:
        CheckpointError: file missing or unreadable, wrong format, or parameter names/shapes differ.
    """
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; start without --resume or pass the right run folder")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads(f.metadata()["sparecycles"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, KeyError, ValueError, SafetensorError) as exc:  # SafetensorError: truncated or not safetensors
        raise CheckpointError(unreadable_message(path, exc)) from exc
    if header.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {header.get('format')}, expected {FORMAT_VERSION}")
    params = dict(model.named_parameters())
    saved = {k[len("model/"):] for k in tensors if k.startswith("model/")}
    if saved != set(params):
        raise CheckpointError(
            f"checkpoint {path} holds parameters {sorted(saved ^ set(params))[:5]}... that do not match the model"
        )
    with torch.no_grad():
        for name, p in params.items():
            src = tensors[f"model/{name}"]
            if src.shape != p.shape:
                raise CheckpointError(f"parameter {name}: checkpoint shape {tuple(src.shape)} != {tuple(p.shape)}")
            p.copy_(src)
    if optimizer is not None:
        om = header["optimizer"]
        state: dict[int, dict[str, Any]] = {}
        for key, t in tensors.items():
            if key.startswith("optim/"):
                _, idx, name = key.split("/", 2)
                state.setdefault(int(idx), {})[name] = t
        for idx, scal in om.get("scalars", {}).items():
            state.setdefault(int(idx), {}).update(scal)
        optimizer.load_state_dict({"state": state, "param_groups": om["param_groups"]})
    extra = {k[len("extra/"):]: t for k, t in tensors.items() if k.startswith("extra/")}
    return int(header["step"]), header["meta"], extra


class Checkpointer:
    """Saves and restores a training run's position in one file: model, the mode's optimizer, the mode's
    extra state (curvature EMA, fp32 masters, counters: `TrainMode.extra_state`) and fixed run metadata.

    Args:
        path: the `.safetensors` file (trainer.run_dir.RunDir.checkpoint).
        model: the model trained; mode: a trainer.modes.TrainMode (its `optimizer` may be None).
        meta: JSON saved with every checkpoint (config, parameter-order hash); the mode's JSON goes under "mode".
    """

    def __init__(self, path: Path, model: torch.nn.Module, mode: Any, meta: dict[str, Any]) -> None:
        self.path, self.model, self.mode, self.meta = path, model, mode, meta

    def save(self, step: int) -> None:
        """Write the checkpoint of `step` completed steps (atomically, replacing the previous one)."""
        tensors, mode_meta = self.mode.extra_state()
        save_checkpoint(self.path, model=self.model, optimizer=self.mode.optimizer, step=step,
                        meta={**self.meta, "mode": mode_meta}, extra=tensors)

    def restore(self) -> int:
        """Load the checkpoint into the model, optimizer and mode; return its step (the next step to run).

        Raises CheckpointError: missing, unreadable, or of another model.
        """
        step, meta, extra = load_checkpoint(self.path, model=self.model, optimizer=self.mode.optimizer)
        self.mode.load_extra_state(extra, meta.get("mode", {}))
        return step
