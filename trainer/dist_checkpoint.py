"""Checkpoints of a torchrun job with torch.distributed.checkpoint (DCP): a folder that any number of ranks can load.

    <run_dir>/checkpoint.dcp/            DCP files: every rank writes its shards (DDP: rank 0 alone, replicated
                                         tensors are deduplicated), `.metadata` names each tensor's chunks
    <run_dir>/checkpoint.dcp/sparecycles.json   step, world size at save, run meta and the mode's JSON state

The state is the model's and optimizer's state dicts as torch.distributed.checkpoint.state_dict gives them
(fully-qualified parameter names, DTensor shards under FSDP2) plus the mode's extra tensors
(`TrainMode.extra_state`), so a run saved with N ranks resumes with any other N, one plain process included:
DCP reads whichever chunks each rank's tensors need (resharding). A save goes to `checkpoint.dcp.tmp` and is
renamed over the last one once every rank has written: a rank that dies mid-save leaves the last one intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import Checkpointer, CheckpointError, checkpoint_step, unreadable_message
from trainer.distributed import DistContext

DCP_NAME = "checkpoint.dcp"
INFO_NAME = "sparecycles.json"
FORMAT_VERSION = 1


class DistCheckpointer:
    """Saves and restores a run's position as a DCP folder, collectively (every rank calls `save`/`restore`).

    Args:
        path: the folder (`<run_dir>/checkpoint.dcp`); model: the (DDP / FSDP2 / plain) module trained; mode: its
        TrainMode; meta: run JSON saved with each checkpoint (the mode's goes under "mode"); ctx: the job;
        legacy: a single-process checkpoint (checkpoint.safetensors) to resume from when no DCP folder exists
        (replicated models only).
    """

    def __init__(self, path: Path, model: torch.nn.Module, mode: Any, meta: dict[str, Any], ctx: DistContext,
                 legacy: Path | None = None) -> None:
        self.path, self.model, self.mode, self.meta, self.ctx, self.legacy = path, model, mode, meta, ctx, legacy

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        opt = self.mode.optimizer
        if opt is None:
            return {"model": get_model_state_dict(self.model), "optim": {}}
        msd, osd = get_state_dict(self.model, opt)
        return {"model": msd, "optim": osd}

    def save(self, step: int) -> None:
        """Write the checkpoint of `step` completed steps (every rank; rank 0 writes the JSON and swaps folders)."""
        import torch.distributed.checkpoint as dcp

        tensors, mode_meta = self.mode.extra_state()
        state = {**self._state(), "extra": {k: v.detach() for k, v in tensors.items()}}
        tmp, old = (self.path.with_name(self.path.name + s) for s in (".tmp", ".old"))
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.ctx.barrier()
        with self._one_process():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not self.ctx.parallel)
        if self.ctx.is_main:
            info = {"format": FORMAT_VERSION, "step": step, "world": self.ctx.world,
                    "meta": {**self.meta, "mode": mode_meta}}
            (tmp / INFO_NAME).write_text(json.dumps(info))
            shutil.rmtree(old, ignore_errors=True)
            if self.path.exists():
                os.replace(self.path, old)
            os.replace(tmp, self.path)
            shutil.rmtree(old, ignore_errors=True)
        self.ctx.barrier()

    @contextlib.contextmanager
    def _one_process(self):
        """Without a process group DCP warns that it assumes one process: that is the intent here (a plain resume)."""
        with warnings.catch_warnings():
            if not self.ctx.parallel:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def _folder(self) -> Path | None:
        old = self.path.with_name(self.path.name + ".old")  # a save that stopped between its two renames
        return next((p for p in (self.path, old) if (p / INFO_NAME).is_file()), None)

    def restore(self) -> int:
        """Load the checkpoint into the model, optimizer and mode on every rank; return its step.

        Raises CheckpointError: none there, unreadable, or of another model (names the first missing tensors).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        folder = self._folder()
        # Newest wins: a plain process may have saved the single-process file after this folder (or before it).
        legacy_newer = folder is not None and _newer(self.legacy, folder)
        found = self.ctx.broadcast_object(folder is not None and not legacy_newer)
        if not found:
            return self._restore_legacy()
        try:
            info = json.loads((folder / INFO_NAME).read_text())
            reader = dcp.FileSystemReader(str(folder))
            saved = reader.read_metadata().state_dict_metadata
        except Exception as exc:  # noqa: BLE001 - a truncated file: JSON, pickle (EOF, unpickling) or OS errors
            raise CheckpointError(unreadable_message(folder, exc)) from exc
        if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {folder} has format {info.get('format') if isinstance(info, dict) else None}"
                                  f", expected {FORMAT_VERSION}")
        extra = {k.split(".", 1)[1]: torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in saved.items() if k.startswith("extra.")}
        state = {**self._state(), "extra": extra}
        try:
            with self._one_process():
                dcp.load(state, storage_reader=reader, no_dist=not self.ctx.parallel)
        except Exception as exc:  # noqa: BLE001 - DCP raises plain RuntimeErrors for missing or misshapen keys
            raise CheckpointError(f"checkpoint {folder} does not fit this run's model ({exc})"[:2000]) from exc
        opt = self.mode.optimizer
        if opt is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.mode.load_extra_state(extra, info["meta"].get("mode", {}))
        return int(info["step"])

    def _restore_legacy(self) -> int:
        if self.legacy is None or not self.legacy.is_file():
            raise CheckpointError(f"no checkpoint at {self.path}; start without --resume or pass the right run folder")
        if self.ctx.shard:
            raise CheckpointError(f"{self.legacy} is a single-process checkpoint: resume it without --shard")
        return Checkpointer(self.legacy, self.model, self.mode, self.meta).restore()


def dcp_step(path: Path) -> int | None:
    """The step of the DCP checkpoint folder `path` (or of the save that stopped between its renames), from its
    JSON alone; None when there is none or it is unreadable."""
    for folder in (path, path.with_name(path.name + ".old")):
        try:
            return int(json.loads((folder / INFO_NAME).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _newer(legacy: Path | None, folder: Path) -> bool:
    """Whether the single-process checkpoint `legacy` holds a later step than the DCP folder `folder`."""
    step = checkpoint_step(legacy) if legacy is not None else None
    return step is not None and step > (dcp_step(folder) or -1)


def make_checkpointer(run_dir: Path, legacy: Path, model: torch.nn.Module, mode: Any, meta: dict[str, Any],
                      ctx: DistContext, resume: bool) -> Checkpointer | DistCheckpointer:
    """The checkpointer of this run: DCP under torchrun, or when resuming a folder whose newest checkpoint a torchrun
    job saved; else the single-process safetensors file (trainer.checkpoint.Checkpointer), unchanged. A folder that
    holds both (a run resumed at another N) resumes from the later step, whichever kind holds it."""
    dcp_dir = run_dir / DCP_NAME
    if ctx.launched or (resume and dcp_step(dcp_dir) is not None and not _newer(legacy, dcp_dir)):
        return DistCheckpointer(dcp_dir, model, mode, meta, ctx, legacy=legacy)
    return Checkpointer(legacy, model, mode, meta)
