"""TensorBoard event files for a run folder, written from the same records as `metrics.jsonl`.

`metrics.jsonl` stays the source of truth; `EventLog.write(rec)` gets every record the loop appends there
and writes its scalars (`scalars_of`) as one TensorBoard event at global step `rec["step"]`, tag = the
JSON key (`loss`, `lr`, `val_loss`, `curv_accepted`, `fleet_probes_per_s`, ...), so
`tensorboard --logdir runs/` shows every run folder as one run. TensorBoard stores scalars as float32
(`Summary.Value.simple_value`), so an event holds the JSON value rounded to float32.

Each training invocation appends to its own file `events.out.tfevents.<ns>.<host>.<pid>` (the name
TensorBoard looks for; `<ns>` is zero-padded so names sort in start order, the order TensorBoard reads
them). A fresh run removes the folder's old event files. A resumed one first rewrites the older files
without the events past its checkpoint step, as the loop truncates `metrics.jsonl` to the records up to
that step: the files then hold exactly metrics.jsonl's records for every reader (TensorBoard's
`SessionLog.START` purge would rely on the reader implementing it). Records are framed as TFRecords
(u64 length, masked CRC32C of the length, Event proto, masked CRC32C of the data; little-endian) with
tensorboardX's protos and CRC, and appended synchronously: no writer thread to close, and a record on disk
in metrics.jsonl is on disk here too.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tensorboardX.proto.event_pb2 import Event
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
    """One TFRecord: u64 length, u32 masked CRC32C(length), payload, u32 masked CRC32C(payload)."""
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def read_events(path: Path) -> Iterator[Event]:
    """The events of one event file, in order; stops at a truncated or corrupt record (a crash mid-write).

    A reader without TensorFlow or TensorBoard: each record's two CRCs are checked.
    """
    data = Path(path).read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        end = pos + 12 + n + 4
        if end > len(data) or struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header):
            return
        payload = data[pos + 12:pos + 12 + n]
        if struct.unpack("<I", data[end - 4:end])[0] != masked_crc32c(payload):
            return
        yield Event.FromString(payload)
        pos = end


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run folder's event files: tag -> [(step, value)] in file-name then write order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(run_dir).glob(EVENTS_GLOB)):
        for ev in read_events(path):
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def _write_atomic(path: Path, events: Iterable[Event]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"".join(_frame(e) for e in events))
    os.replace(tmp, path)


class EventLog:
    """Append-only TensorBoard event file of one training invocation in `run_dir`.

    Args:
        run_dir: the run folder (created if missing).
        resume_step: None for a fresh run (the folder's old `events.out.tfevents.*` files are deleted);
            the checkpoint step a resumed run continues from otherwise (older files lose their events with a
            larger step, and a torn last record).

    Raises:
        OSError: the folder or a file cannot be written.
    """

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in sorted(run_dir.glob(EVENTS_GLOB)):
            if resume_step is None:
                old.unlink()
            else:
                _write_atomic(old, [e for e in read_events(old) if e.step <= resume_step])
        name = f"events.out.tfevents.{time.time_ns():020d}.{socket.gethostname()}.{os.getpid()}"
        self.path = run_dir / name
        self._append([Event(wall_time=time.time(), file_version="brain.Event:2")])

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
