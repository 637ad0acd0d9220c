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


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str, total: int, completed: int,
                  status: Callable[[], str] | None) -> Iterator[Callable[[int, str], None]]:
    """A rich progress bar over the steps; yields show(done, text), which also appends `status()` if given."""
    with status_progress(disable=not enabled) as bar:
        bar_id = bar.add_task(description, total=total, completed=completed, status="")

        def show(done: int, text: str) -> None:
            bar.update(bar_id, completed=done, status=f"{text} | {status()}" if status else text)

        yield show


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C (SIGINT) or SIGTERM into a flag checked between steps (a step is never cut in
    half); the run then checkpoints and raises KeyboardInterrupt. A second signal interrupts at once.
    Outside the main thread signals cannot be caught: no-op.
    """
    hit = {"n": 0}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        hit["n"] += 1
        if hit["n"] > 1:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: hit["n"] > 0
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
