"""The trainer under torchrun: process group, ranks, data parallelism (DDP / FSDP2), batch shards, collectives.

`sparecycles train` run by `torchrun --nproc-per-node N -m sparecycles.cli train ...` (or `train --nproc-per-node N`,
which launches exactly that) runs one copy of trainer.train.train per rank. Every rank

- builds the same model from the run seed; first-order and ZO-Curv runs make it data-parallel with PyTorch's own
  DDP (the composable `replicate`, which keeps the module and its parameter names) or, with `--shard`, shards
  it with FSDP2 (`torch.distributed.fsdp.fully_shard`, first-order only);
- reads its shard of the step's global batch (`batch_for`: rows [r·B/N, (r+1)·B/N) of `task.batch(step)`, a pure
  function of step and rank), optionally as micro-batches (gradient accumulation of first-order and ZO-Curv
  runs; ZO-Curv probes the shard's first rows, joined from them: `whole`), so the global batch is the same
  whatever N and the micro-batch size are; pure-ZO runs read the whole batch and shard their probes instead (trainer.dist_backends);
- logs the global-batch loss (`mean_over_ranks`), evaluates, and checkpoints collectively
  (trainer.dist_checkpoint, torch.distributed.checkpoint).

Rank 0 alone writes the run folder, metrics and export, and alone talks to a fleet's coordinator: it broadcasts
the round results the others need (trainer.dist_backends.LeaderBackend). A plain run (no torchrun) gets
`SINGLE`, whose every method is the identity: its behaviour is unchanged bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class DistributedError(RuntimeError):
    """A multi-process run cannot start or continue (too many ranks for the devices, an unsupported combination,
    a rank that stopped answering)."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a torchrun job, and the job's data-parallel settings.

    Attributes:
        rank, world, local_rank: this process's global rank, the number of processes N, its rank on its host.
        launched: started by torchrun (even with N = 1): checkpoints are torch.distributed.checkpoint folders.
        shard: FSDP2 (`fully_shard`) instead of DDP.
        micro_batch_size: sequences per forward/backward on each rank (None: the whole shard, no accumulation).
        fleet: a fleet's coordinator probes this run (rank 0 talks to it, the others follow).
        fleet_rounds: when its ZO-Curv rounds fold (trainer.zo.rounds.FOLD_TIMINGS): every rank's round book
            follows the same timing, so the followers receive exactly the collects rank 0 makes.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launched: bool = False
    shard: bool = False
    micro_batch_size: int | None = None
    fleet: bool = False
    fleet_rounds: str = "async"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and talks to the coordinator."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        """More than one process."""
        return self.world > 1

    # ---- collectives (identities on one process) --------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; small objects only: round results, flags, metadata)."""
        if not self.parallel:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.parallel:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any: ranks agree to stop at the same step (one all-reduce)."""
        if not self.parallel:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def mean_over_ranks(self, stats: dict[str, float], keys: tuple[str, ...] = ("loss",)) -> dict[str, float]:
        """`stats` with `keys` averaged over the ranks (float64): each rank's loss is the mean over its equal
        shard, so their mean is the global batch's loss. Identity on one process."""
        if not self.parallel:
            return stats
        present = [k for k in keys if k in stats]
        t = torch.tensor([stats[k] for k in present], dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(t)
        return {**stats, **{k: float(v) / self.world for k, v in zip(present, t.tolist(), strict=True)}}

    def barrier(self) -> None:
        if self.parallel:
            torch.distributed.barrier()

    def _comm_device(self) -> torch.device:
        backend = torch.distributed.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # ---- data parallelism ---------------------------------------------------------------------------------
    def check(self, cfg: Any, kind: str) -> None:
        """Refuse settings this job cannot run, before anything is built (ValueError with the fix)."""
        if self.parallel and getattr(cfg, "anytime", None) is not None:
            # The anytime model keeps, scores and (--pull) moves to past versions on one process's copy.
            raise ValueError("--anytime runs in one process: drop it or --nproc-per-node")
        if self.shard and kind != "first-order":
            raise ValueError(f"--shard (FSDP2) runs first-order optimizers only; {cfg.optimizer} is {kind}: run it "
                             "with DDP (drop --shard)")
        if kind == "pure-zo":
            if self.micro_batch_size is not None:
                raise ValueError("--micro-batch-size: pure-ZO runs shard their probes, not the batch; drop it")
            return
        rows = self.rows(cfg.batch_size)
        if self.micro_batch_size is not None and rows % self.micro_batch_size:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must divide the {rows} sequences per rank "
                             "(batch size / N)")
        if kind == "zo-curv" and self.parallel and cfg.probe_batch_size > rows:
            raise ValueError(f"--probe-batch-size {cfg.probe_batch_size} exceeds the {rows} sequences per rank: "
                             "rank 0 probes the first rows of its shard; lower it or --nproc-per-node")

    def rows(self, batch_size: int) -> int:
        """Sequences per rank of a global batch of `batch_size`. Raises ValueError unless N divides it."""
        if batch_size % self.world:
            raise ValueError(f"--batch-size {batch_size} is not a multiple of the {self.world} ranks: each rank "
                             "takes an equal shard of the global batch")
        return batch_size // self.world

    def prepare_model(self, model: torch.nn.Module, kind: str) -> torch.nn.Module:
        """Make `model` data-parallel in place: DDP (`replicate`: gradients all-reduced in backward, parameters
        broadcast from rank 0 first) or FSDP2 (`fully_shard` per transformer block, then the root). Pure-ZO
        models take no gradients and stay plain. Returns the same module."""
        if not self.parallel or kind == "pure-zo":
            return model
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for block in [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]:
                fully_shard(block)
            fully_shard(model)
            return model
        from torch.distributed._composable import replicate

        # forward_sync_buffers=False: no collective in forward, so ranks may run different numbers of probe forwards.
        original = type(model)
        replicate(model, forward_sync_buffers=False)
        # replicate swaps in a subclass named "DDP<class>"; a fleet names the architecture its workers build by the
        # class name (RunSpec.model_class, the batch kind), so the subclass keeps the transformers class's name.
        type(model).__name__, type(model).__qualname__ = original.__name__, original.__qualname__
        return model

    def full_model(self, model: torch.nn.Module, build: Any) -> torch.nn.Module:
        """A plain module holding the full weights, for export: `model` itself unless FSDP2-sharded; then every rank
        gathers the full state dict (collective) and rank 0 loads it into `build()` (a fresh model)."""
        if not self.shard:
            return model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return model
        plain = build()
        plain.load_state_dict(full)
        return plain

    def batch_for(self, task: Any, step: int, kind: str) -> Any:
        """This rank's part of step `step`'s global batch: the whole batch for pure ZO (its probes are sharded),
        else rows [r·B/N, (r+1)·B/N), as `MicroBatches` when `micro_batch_size` splits them further."""
        batch = task.batch(step)
        if not self.parallel and self.micro_batch_size is None or kind == "pure-zo":
            return batch
        rows = _rows_of(batch)
        per = self.rows(rows)
        mine = _slice_rows(batch, self.rank * per, (self.rank + 1) * per)
        if self.micro_batch_size is None or self.micro_batch_size >= per:
            return mine
        m = self.micro_batch_size
        return MicroBatches([_slice_rows(mine, i, i + m) for i in range(0, per, m)])


SINGLE = DistContext()


class MicroBatches(list):
    """A rank's shard split into equal micro-batches: one forward/backward each, gradients summed (accumulation)."""


def whole(batch: Any) -> Any:
    """A rank's shard as one batch: `batch` itself, or the parts of `MicroBatches` joined row-wise in order (the
    same rows, the same values: ZO-Curv probes the first rows of it whatever the micro-batch size)."""
    if not isinstance(batch, MicroBatches):
        return batch
    return _join_rows(list(batch))


def _join_rows(parts: list[Any]) -> Any:
    """Row-wise concatenation of batches of one structure (tensors, or tuples/lists/dicts of tensors)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {k: _join_rows([p[k] for p in parts]) for k in first}
    return type(first)(_join_rows(list(col)) for col in zip(*parts, strict=True))


def backward(model: torch.nn.Module, loss_fn: Any, batch: Any) -> torch.Tensor:
    """Backprop `loss_fn(model, batch)` and return the loss (detached scalar, nats). For `MicroBatches`: one
    backward per part of loss/M, gradient sync (DDP all-reduce / FSDP2 reduce-scatter) only on the last, so the
    gradient is the one of the mean loss over the shard; returns that mean loss."""
    if not isinstance(batch, MicroBatches):
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.detach()
    sync = getattr(model, "set_requires_gradient_sync", None)
    total = torch.zeros((), dtype=torch.float64)
    for i, part in enumerate(batch):
        if sync is not None:
            sync(i == len(batch) - 1)
        loss = loss_fn(model, part)
        (loss / len(batch)).backward()
        total += float(loss.detach())
    return total / len(batch)


def _rows_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _rows_of(next(iter(batch.values())))
    return _rows_of(batch[0])


def _slice_rows(batch: Any, lo: int, hi: int) -> Any:
    """Rows [lo, hi) of a batch: a tensor, or a tuple/list/dict of tensors sharing dim 0."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, dict):
        return {k: _slice_rows(v, lo, hi) for k, v in batch.items()}
    return type(batch)(_slice_rows(t, lo, hi) for t in batch)


def launched_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process: its rank variables are set."""
    return all(k in os.environ for k in LAUNCH_ENV)


def setup(*, device: str, shard: bool = False, micro_batch_size: int | None = None, fleet: bool = False,
          timeout_s: float = 600.0, fleet_rounds: str = "async") -> DistContext:
    """The job's DistContext; under torchrun also join the process group (gloo on CPU, NCCL on CUDA, collectives
    failing after `timeout_s` so a rank that stops answering ends the run instead of hanging it) and pin CUDA
    rank r to cuda:LOCAL_RANK. Outside torchrun: `SINGLE` (or its options, for accumulation on one process).

    Raises:
        ValueError: more ranks on this host than CUDA devices, `--device cuda:K` with N > 1, CUDA absent.
        DistributedError: the process group could not form within `timeout_s`.
    """
    if not launched_by_torchrun():
        if shard:
            raise ValueError("--shard needs torchrun: pass --nproc-per-node N")
        return DistContext(micro_batch_size=micro_batch_size, fleet=fleet, fleet_rounds=fleet_rounds)
    rank, world, local = (int(os.environ[k]) for k in LAUNCH_ENV)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
        if local_world > torch.cuda.device_count():
            raise ValueError(f"--nproc-per-node {local_world} exceeds the {torch.cuda.device_count()} CUDA device(s) "
                             "of this machine: one rank per GPU")
        if ":" in device and world > 1:
            raise ValueError(f"--device {device} under torchrun with N > 1: pass --device cuda (rank r uses "
                             "cuda:LOCAL_RANK)")
        torch.cuda.set_device(local if ":" not in device else int(device.split(":")[1]))
    if shard and not _fsdp2_available():
        raise ValueError("--shard: this torch build has no FSDP2 (torch.distributed.fsdp.fully_shard); drop --shard")
    if not torch.distributed.is_initialized():
        try:
            torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - any failure to form the group is reported the same way
            raise DistributedError(f"rank {rank}: the process group of {world} ranks did not form ({exc})") from exc
    return DistContext(rank=rank, world=world, local_rank=local, launched=True, shard=shard,
                       micro_batch_size=micro_batch_size, fleet=fleet, fleet_rounds=fleet_rounds)


def _fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def teardown(ctx: DistContext) -> None:
    """Leave the process group (end of a torchrun rank's run)."""
    if ctx.launched and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
