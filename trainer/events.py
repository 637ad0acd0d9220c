"""TensorBoard event files for a run folder, written from the same records as `metrics.jsonl`.

`metrics.jsonl` stays the source of truth; `EventLog.write(rec)` gets every record the loop appends there
and writes its scalars (`scalars_of`) as one TensorBoard event at global step `rec["step"]`, tag = the
JSON key (`loss`, `lr`, `val_loss`, `curv_accepted`, ...), so `tensorboard --logdir runs/` shows every
run folder as one run. TensorBoard stores scalars as float32 (`Summary.Value.simple_value`), so an event
holds the JSON value rounded to float32.

Each training invocation appends to its own file `events.out.tfevents.<ns>.<host>.<pid>` (the name
TensorBoard looks for; `<ns>` is zero-padded so names sort in start order, the order TensorBoard reads
them). A fresh run removes the folder's old event files; a resumed one opens with a `SessionLog.START`
at step `resume_step + 1`, which makes TensorBoard drop what earlier files logged past the checkpoint
(the loop truncates `metrics.jsonl` to the same records). Records are framed as TFRecords (length,
masked CRC32C of the length, Event proto, masked CRC32C of the data) with tensorboardX's protos and CRC,
and appended synchronously: no writer thread to close, and a record on disk in metrics.jsonl is on disk
here too.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

EVENTS_GLOB = "events.out.tfevents.*"


def scalars_of(rec: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics record: every int or float field except "step", as float.

    Bools, strings, lists and dicts are not scalars and are skipped; non-finite floats are kept (TensorBoard
    shows NaN/inf). Pure function.
    """
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _frame(event: Event) -> bytes:
    """One TFRecord: u64 length, u32 masked CRC32C(length), payload, u32 masked CRC32C(payload), little-endian."""
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


class EventLog:
    """Append-only TensorBoard event file of one training invocation in `run_dir`.

    Args:
        run_dir: the run folder (created if missing).
        resume_step: None for a fresh run (the folder's old `events.out.tfevents.*` files are deleted);
            the checkpoint step a resumed run continues from otherwise (events of earlier files with a
            step above it are purged when TensorBoard reads the folder).

    Raises:
        OSError: the folder or file cannot be written.
    """

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for old in run_dir.glob(EVENTS_GLOB):
                old.unlink()
        self.path = run_dir / f"events.out.tfevents.{time.time_ns():020d}.{socket.gethostname()}.{os.getpid()}"
        now = time.time()
        head = [Event(wall_time=now, file_version="brain.Event:2")]
        if resume_step is not None:
            head.append(Event(wall_time=now, step=int(resume_step) + 1,
                              session_log=SessionLog(status=SessionLog.START)))
        self._append(head)

    def write(self, rec: Mapping[str, Any]) -> None:
        """Append the scalars of one metrics record (it must hold an int "step"); no-op if it has none.

        Raises KeyError if "step" is missing.
        """
        values = scalars_of(rec)
        step = int(rec["step"])
        if values:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
            self._append([Event(wall_time=time.time(), step=step, summary=summary)])

    def _append(self, events: Iterable[Event]) -> None:
        with self.path.open("ab") as f:
            f.write(b"".join(_frame(e) for e in events))

