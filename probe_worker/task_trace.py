"""A worker's task trace (`sparecycles worker --task-trace PATH`): one JSON line per task, and per serving-gate change,
which `bench serving` reads and plots; and where a cut found a task (its innermost project frames)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import threading
from pathlib import Path


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    """The folders of the packages a task runs in (probe_worker, probe_kernels, trainer, wire), each ending in a
    separator: a frame counts by where its file is, not by a folder name in its path (tests/probe_worker/ is no
    package frame)."""
    dirs = []
    for pkg in ("probe_worker", "probe_kernels", "trainer", "wire"):
        spec = importlib.util.find_spec(pkg)
        dirs += [os.path.join(os.path.realpath(d), "") for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(dirs)


def where_in(thread: int) -> str:
    """The innermost frames of `thread` in this project's packages, innermost last ("file:function:line > ..."); a
    diagnostic of where a cut found a task."""
    import sys

    frame, out, dirs = sys._current_frames().get(thread), [], _package_dirs()
    while frame is not None and len(out) < 4:
        code = frame.f_code
        if os.path.realpath(code.co_filename).startswith(dirs):
            out.append(f"{Path(code.co_filename).stem}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " > ".join(reversed(out))


class TraceFile:
    """Appends one JSON line per task, {"start": s, "end": s, "outcome": name} (unix seconds; a cut task adds "fired",
    "where" and "stopped"; a task the freeze watcher stopped, "frozen"), to `path`; and, from
    a serving worker's watch, one per gate change, {"event": "yield"|"resume", "t": s, ...} (`event`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def __call__(self, start: float, end: float, outcome: str, fired: float | None = None, where: str = "",
                 stopped: float | None = None, frozen: float | None = None) -> None:
        extra = {"fired": round(fired, 6), "where": where} if fired is not None else {}
        if stopped is not None:  # a cut task: its evaluation stopped here; its hand-back took until `end`
            extra["stopped"] = round(stopped, 6)
        if frozen is not None:  # the freeze watcher first stopped the worker here (probe_worker.freeze)
            extra["frozen"] = round(frozen, 6)
        self._write({"start": round(start, 6), "end": round(end, 6), "outcome": outcome, **extra})

    def event(self, kind: str, t: float, **fields: float | bool | None) -> None:
        """One event line: `kind` at unix time `t` with `fields` (numbers rounded to microseconds)."""
        self._write({"event": kind, "t": round(t, 6),
                     **{k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()}})

    def _write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
