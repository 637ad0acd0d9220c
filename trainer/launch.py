"""Launching `sparecycles train` / `up` under torchrun: the checks said before any rank starts, the process-group
backend a launch uses, and the one launcher (`launch_torchrun`) of `train --nproc-per-node` and `up --nproc-per-node`.
Imports torch only to count CUDA devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import typer


def check_launch(cfg, shard: bool, nproc: int, micro_batch_size: int | None = None) -> None:
    """What trainer.distributed.DistContext.check refuses on every rank, said before torchrun starts any
    (typer.BadParameter, exit 2): --shard with a method that is not first-order, --anytime on more than one rank,
    and `check_ranks`' batch splits."""
    from trainer.methods import get_method

    kind = get_method(cfg.optimizer).kind
    if shard and kind != "first-order":
        raise typer.BadParameter(f"--shard (FSDP2) runs first-order optimizers only; {cfg.optimizer} is {kind}: "
                                 "run it with DDP (drop --shard)", param_hint="--shard")
    if nproc > 1 and getattr(cfg, "anytime", None) is not None:
        raise typer.BadParameter("--anytime runs in one process: drop it or --nproc-per-node", param_hint="--anytime")
    try:
        check_ranks(nproc, (cfg,), micro_batch_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--nproc-per-node") from None


def check_ranks(nproc: int, cfgs: tuple, micro_batch_size: int | None = None) -> None:
    """What every one of `nproc` ranks would refuse for each run config (trainer.distributed.DistContext.check: a
    batch the ranks cannot split, a micro-batch that does not divide a rank's shard, a ZO-Curv probe batch larger
    than a rank's shard), said before torchrun starts any. Raises ValueError naming the option."""
    from trainer.distributed import DistContext
    from trainer.methods import get_method

    ranks = DistContext(world=nproc, launched=True, micro_batch_size=micro_batch_size)
    for cfg in cfgs:
        ranks.check(cfg, get_method(cfg.optimizer).kind)


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (as trainer.distributed.launched_by_torchrun, without importing torch)."""
    import os

    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch_backend(nproc: int, device: str | None) -> str:
    """The process-group backend `nproc` ranks on this machine use on `device`: "gloo" on the CPU, "nccl" on CUDA
    (one rank per GPU, rank r on cuda:r). Said before torchrun starts any rank (`train`/`up --nproc-per-node`); the
    ranks check it again (trainer.distributed.setup). Imports torch only for CUDA.

    Raises:
        ValueError: CUDA asked for where torch sees none, or more ranks than CUDA devices.
    """
    if not (device or "cpu").startswith("cuda"):
        return "gloo"
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    have = torch.cuda.device_count()
    if nproc > have:
        raise ValueError(f"--nproc-per-node {nproc} exceeds the {have} CUDA device(s) of this machine: one rank "
                         "per GPU")
    return "nccl"


def launch_torchrun(nproc: int, args: list[str], *, env: dict[str, str] | None = None,
                    preexec_fn: Callable[[], None] | None = None, stop_grace_s: float = 120.0) -> int:
    """Run `sparecycles ARGS` under torchrun (`python -m trainer.torchrun_agent --standalone`: torchrun's agent,
    whose stop by signal is one line, not a traceback) with `nproc` processes on this machine and return its exit
    status: the one launcher of `train --nproc-per-node` and `up --nproc-per-node`. `env`: the ranks' environment
    (default: this one; PYTHONFAULTHANDLER=1 added, so a rank killed by a fatal signal
    prints its Python stack); `preexec_fn`: runs in torchrun's
    process before it starts (`up`: die with its parent).

    torchrun starts in a session of its own (a terminal's Ctrl-C reaches this process only): Ctrl-C here, or a
    SIGTERM while it waits, sends torchrun one SIGTERM, which it passes to every rank (they stop after the same step
    and checkpoint: trainer.console.deferred_interrupt); this waits up to `stop_grace_s` seconds for it (then kills
    it) and raises KeyboardInterrupt.
    """
    import os
    import signal
    import subprocess
    import sys
    import threading

    def _interrupt(signum, frame):
        from trainer.console import note_stop

        note_stop(signum)  # the exit status of the command that stops (trainer.console.stop_status)
        raise KeyboardInterrupt

    cmd = [sys.executable, "-m", "trainer.torchrun_agent", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sparecycles.cli", *args]
    # A rank that dies in native code (a SIGABRT from a C++ terminate) prints its Python stack: the one clue to why.
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    main = threading.current_thread() is threading.main_thread()
    # SIGINT too: a process started in the background by a shell inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler of its own (a `kill -INT` to `up`/`train` would be dropped while ranks train).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=preexec_fn)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_rank(entry: Callable[[], object]) -> NoReturn:
    """Run `entry` (the CLI) as a torchrun rank and end the process with its exit status through `os._exit`, once
    stdout and stderr are flushed: a rank's interpreter never finalizes. Why: after a rank's run (and its
    `destroy_process_group`), finalizing the interpreter races the native threads torch's gloo process group
    leaves behind; the race ended a finished rank 1 with SIGABRT ("terminate called without an active
    exception", main thread past its last Python frame) while rank 0 was still writing its summary, and torchrun
    then stopped rank 0 (pytorch/pytorch PR 179291 describes the same teardown race). Every file a run writes is
    closed by its own `with` before this point; nothing a rank needs runs at exit.

    Exit status: `entry`'s SystemExit code (typer.Exit), 130 for a KeyboardInterrupt, 1 for any other exception
    (its traceback printed first).
    """
    import os
    import sys
    import traceback

    try:
        entry()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)  # as Python prints a SystemExit("message")
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - any error ends the rank, as an uncaught one would, but without finalizing
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def relaunch(nproc: int, device: str | None) -> int:
    """Re-run this `train` command (its own arguments, less --nproc-per-node) under torchrun with `nproc` processes
    (`launch_torchrun`); returns its exit status. Refuses (exit 2) more CUDA ranks than this machine has GPUs."""
    import sys

    try:
        launch_backend(nproc, device)
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        return 2
    args, skip = [], False
    for a in sys.argv[1:]:  # this command's own arguments, without --nproc-per-node
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            args.append(a)
    return launch_torchrun(nproc, args)
