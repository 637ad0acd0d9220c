"""The training loop's console: a progress bar with a status line of its own, transformers' bars kept out of log
files, and Ctrl-C/SIGTERM turned into a flag checked between steps. No torch."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


def quiet_hf_bars(progress: bool) -> None:
    """Turn transformers' own progress bars ("Loading weights", "Writing model shards") off when `progress` is off
    or stderr is no terminal (a log file): there each redraw would be a line of `\r`-joined bars. Our display
    (rich) draws one final line there."""
    if not progress or not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def status_progress(**kwargs: Any):
    """A rich Progress over the steps whose status text (loss, val, the fleet's workers and probes/s) has a line of
    its own under the bar, folded rather than cut at the terminal's width (on one line, 80 columns cut it)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class StatusProgress(Progress):
        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                if task.fields.get("status"):
                    yield Text("  " + task.fields["status"], overflow="fold")

    return StatusProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), **kwargs)


PLAIN_EVERY_S = 30.0  # without a terminal: a progress line at least this often (besides every 5% of the steps)


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str, total: int, completed: int,
                  status: Callable[[], str] | None) -> Iterator[Callable[[int, str], None]]:
    """A rich progress bar over the steps; yields show(done, text), which also appends `status()` if given.

    When the console is no terminal (output to a log file or a pipe), rich would draw the bar only at the end: the
    steps are then reported as plain lines on stderr instead (`plain_progress`)."""
    from rich.console import Console

    if enabled and not Console().is_terminal:
        yield plain_progress(description, total, status)
        return
    with status_progress(disable=not enabled) as bar:
        bar_id = bar.add_task(description, total=total, completed=completed, status="")

        def show(done: int, text: str) -> None:
            bar.update(bar_id, completed=done, status=f"{text} | {status()}" if status else text)

        yield show


def plain_progress(description: str, total: int, status: Callable[[], str] | None = None,
                   write: Callable[[str], None] | None = None) -> Callable[[int, str], None]:
    """show(done, text) for a console that is no terminal: one line "DESCRIPTION step DONE/TOTAL (P%) TEXT | STATUS"
    (to `write`, default stderr) at each twentieth of `total` (every step when total <= 20), at the last step, and
    whenever PLAIN_EVERY_S seconds passed since the previous line; nothing in between."""
    import time

    out = write or (lambda line: print(line, file=sys.stderr, flush=True))
    last = {"part": -1, "at": time.monotonic()}

    def show(done: int, text: str) -> None:
        part = done * 20 // max(1, total)
        if part == last["part"] and done != total and time.monotonic() - last["at"] < PLAIN_EVERY_S:
            return
        last.update(part=part, at=time.monotonic())
        out(f"{description} step {done}/{total} ({100 * done // max(1, total)}%) {text}"
            + (f" | {status()}" if status else ""))

    return show


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended a run after its step loop checkpointed: `step` (optimizer steps done, the checkpoint's
    position) and `run_dir` (the folder that holds it) are what the console's stop line names."""

    def __init__(self, step: int, run_dir: Any) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.run_dir = step, run_dir


# The signal that asked this process to stop (the first of the stop, SIGINT or SIGTERM), noted by the stop handlers
# (here and trainer.launch.launch_torchrun's): a clean stop exits with 128 + it (stop_status).
_STOPPED_BY: list[int] = []


def note_stop(signum: int) -> None:
    """Note `signum` as the signal that stops this process, unless one was noted since `stop_signals` began."""
    if not _STOPPED_BY:
        _STOPPED_BY.append(signum)


def stop_status() -> int:
    """The exit status of a clean stop: 128 + the signal that asked for it, as a shell reports a process that signal
    ended: 143 for SIGTERM (`kill`, `timeout`, Docker/Compose and Kubernetes stops), 130 for SIGINT (Ctrl-C), also
    when none was noted (a KeyboardInterrupt from Python's own SIGINT handler)."""
    return 128 + (_STOPPED_BY[0] if _STOPPED_BY else signal.SIGINT)


def _raise_interrupt(signum, frame):
    note_stop(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt from here on (the first instruction of `up` and `train`, so start-up
    is covered too); the previous handlers come back on exit. SIGINT gets one (raising as Python's own does) even when
    this process inherited SIGINT *ignored*: a process started in the background by a non-interactive shell (`cmd &` in a script,
    a CI job) does, Python then installs no handler, and a Ctrl-C / `kill -INT` was dropped until the step loop's own
    handler (deferred_interrupt) took over: it then looked as if the first signal was ignored and a second one
    needed. The signal is noted for the exit status (stop_status). Outside the main thread signals cannot be caught:
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOPPED_BY.clear()
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# Set by deferred_interrupt's first signal until the run stops: a wait inside a step gives up at once instead of
# holding the stop for its whole timeout (a teacher round's --kd-strict wait, fleet.teacher; a fleet round's results,
# fleet.collector: raise_if_stopping).
STOP_REQUESTED = threading.Event()


class StopWaiting(KeyboardInterrupt):
    """A wait inside a step gave up because the run is stopping (STOP_REQUESTED: the first Ctrl-C or SIGTERM): the
    step is cut where it waited, and the step loop checkpoints the steps completed before it, as after an error the
    step raised (the state a cut step leaves is resumable: trainer.zo.modes.ZOCurvMode re-issues its rounds)."""


def raise_if_stopping(what: str) -> None:
    """Raise StopWaiting (naming `what`, the thing waited for) once the run is stopping; else nothing. Called between
    the reads of a wait that would otherwise hold a stop for its whole timeout (a fleet round's results: up to the
    round timeout, 300 s)."""
    if STOP_REQUESTED.is_set():
        raise StopWaiting(f"stopped waiting for {what}: the run is stopping")


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C (SIGINT) or SIGTERM into a flag checked between steps (a step is not cut in half, but
    for a wait inside it that gives up on STOP_REQUESTED: raise_if_stopping); the run then checkpoints and raises
    KeyboardInterrupt. A second signal interrupts at once.
    Outside the main thread signals cannot be caught: no-op.
    """
    hit = {"n": 0}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        hit["n"] += 1
        note_stop(signum)
        STOP_REQUESTED.set()
        if hit["n"] > 1:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    STOP_REQUESTED.clear()
    try:
        yield lambda: hit["n"] > 0
    finally:
        STOP_REQUESTED.clear()
        for sig, old in previous.items():
            signal.signal(sig, old)


def resume_command(argv: list[str]) -> str:
    """The `sparecycles` command that continues the run `argv` (this process's arguments after the program) began:
    the same arguments, `--overwrite` dropped (it would start afresh) and `--resume` added."""
    import shlex

    args = [a for a in argv if a not in ("--overwrite", "--resume", "--no-resume")]
    return shlex.join(["sparecycles", *args, "--resume"])


def stop_line(exc: BaseException, argv: list[str], rank: int | None = None) -> str | None:
    """The one line `train` prints when Ctrl-C or SIGTERM stopped it: the step checkpointed (a
    trainer.console.Interrupted from the step loop) and the command that resumes; before the first step, that
    nothing was trained. `rank`: this process's rank under torchrun (rank 0 says its step, the others nothing: the
    launching `train` prints the resume command). None: print nothing."""
    step = getattr(exc, "step", None)
    if rank is not None:
        return f"stopped after step {step}: checkpointed in {exc.run_dir}" if rank == 0 and step is not None else None
    if step is not None:
        return f"stopped after step {step}, checkpointed in {exc.run_dir}; resume with: {resume_command(argv)}"
    if any(a == "--nproc-per-node" or a.startswith("--nproc-per-node=") for a in argv):
        return f"stopped: the ranks checkpointed where they stopped (their line above); resume with: {resume_command(argv)}"
    return "stopped before training began: nothing new was checkpointed; rerun the same command"


def stops_cleanly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a typer command (`train`) so that SIGINT and SIGTERM are handled from its first instruction
    (stop_signals) and a stop ends with stop_line and exit status stop_status() (SIGTERM 143, Ctrl-C 130), no
    traceback."""
    import functools
    import os

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import typer

        with stop_signals():
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt as exc:
                ranked = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))  # launched by torchrun
                rank = int(os.environ["RANK"]) if ranked else None
                line = stop_line(exc, sys.argv[1:], rank)
                if line:
                    typer.echo(line, err=True)
                raise typer.Exit(stop_status()) from None

    return wrapper
