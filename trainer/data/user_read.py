"""A user's text (`--data PATH`): finding the input files and reading their documents, with one-line refusals.

Inputs (a file, a folder searched recursively, or a glob):
- `.txt`: one document per file, UTF-8 (a leading BOM dropped).
- `.jsonl`, and `.json` holding JSON lines: one document per line, the string field `text_field`.
- `.json` holding one JSON array of objects: one document per object, its field `text_field`.
- `.parquet`: one document per row of the string column `text_field` (pyarrow).
- a folder written by `datasets`' `save_to_disk` (a Dataset: state.json + dataset_info.json; or a DatasetDict:
  dataset_dict.json, every split in its listed order): one document per row of `text_field`.
Hidden files and folders (a leading ".") are skipped. Empty texts ("" or whitespace) are skipped and counted;
everything else is kept byte for byte (no normalisation: the model's own tokenizer sees the user's text).

Every refusal is a `DataInputError` (a ValueError) with one line naming the file and, where it applies, the line,
row, field or byte offset.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FORMAT = "sparecycles-user-corpus"  # manifest["format"] of a packed user corpus (trainer.data.user)
SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
DATASET_MARKERS = ("dataset_dict.json", "state.json")  # save_to_disk of a DatasetDict / a Dataset
BINARY_PROBE = 8192  # bytes searched for a NUL: a text file has none (git's binary heuristic)
BOM = b"\xef\xbb\xbf"
EncodingErrors = Literal["strict", "replace"]


class DataInputError(ValueError):
    """Bad `--data` input: one line naming the file (and line, row, field or byte offset)."""


@dataclass(frozen=True)
class InputFile:
    """One input: `path` (absolute), `rel` (its name under the data root, as the manifest lists it), `kind`
    ("txt", "jsonl", "json", "parquet" or "datasets" for a save_to_disk folder)."""

    path: Path
    rel: str
    kind: str

    def files(self) -> list[Path]:
        """The files whose bytes make this input (a datasets folder: every file in it), sorted."""
        if self.kind != "datasets":
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not _hidden(p.relative_to(self.path)))


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _is_dataset_dir(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _kind(path: Path) -> str | None:
    return "datasets" if path.is_dir() and _is_dataset_dir(path) else SUFFIXES.get(path.suffix.lower())


def _walk(root: Path) -> Iterator[Path]:
    """Files and datasets folders under `root` (a datasets folder is not descended into), sorted by name."""
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            if _is_dataset_dir(child):
                yield child
            else:
                yield from _walk(child)
        elif child.is_file():
            yield child


def find_inputs(data: str) -> tuple[Path, list[InputFile]]:
    """The data root and the inputs of `--data data` (a file, a folder, or a glob such as `texts/**/*.txt`),
    sorted by name under the root.

    Raises:
        DataInputError: nothing at `data`; a file of an unsupported type; a folder or glob with no inputs.
    """
    path = Path(data).expanduser()
    supported = ", ".join(SUFFIXES) + " or a datasets save_to_disk folder"
    if glob.has_magic(data):
        hits = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        fixed = path.parts[:next(i for i, part in enumerate(path.parts) if glob.has_magic(part))]
        root = Path(*fixed).resolve() if fixed else Path.cwd()
        found = [(p, _kind(p)) for p in hits if (p.is_file() or p.is_dir()) and not p.name.startswith(".")]
        inputs = [InputFile(p.resolve(), str(p.resolve().relative_to(root)), k) for p, k in found if k]
        if not inputs:
            raise DataInputError(f"--data {data}: the pattern matches no input files ({supported})")
        return root, inputs
    if not path.exists():
        raise DataInputError(f"--data {data}: no such file or folder")
    path = path.resolve()
    if path.is_file() or _is_dataset_dir(path):
        kind = _kind(path)
        if kind is None:
            raise DataInputError(f"{path}: unsupported file type {path.suffix or '(no suffix)'!r} ({supported})")
        return path.parent, [InputFile(path, path.name, kind)]
    inputs = [InputFile(p, str(p.relative_to(path)), k) for p in _walk(path) if (k := _kind(p))]
    if not inputs:
        raise DataInputError(f"{path}: the folder holds no text files ({supported})")
    return path, inputs


def skipped_files(data: str) -> list[Path]:
    """The files under a `--data` folder (or matched by its glob) that `find_inputs` leaves out for their type (a
    .csv beside the .txt files), sorted; hidden files and folders are not counted. [] for a single file or a path
    that does not exist."""
    path = Path(data).expanduser()
    if glob.has_magic(data):
        hits = (Path(p) for p in glob.glob(str(path), recursive=True))
        return sorted(p for p in hits if p.is_file() and not p.name.startswith(".") and _kind(p) is None)
    if not path.is_dir() or _is_dataset_dir(path):
        return []
    return [p for p in _walk(path.resolve()) if _kind(p) is None]


def skipped_warning(data: str) -> str | None:
    """The warning for the files `skipped_files` leaves out of `--data data` (naming a few and the types read), None
    when none is."""
    skipped = skipped_files(data)
    if not skipped:
        return None
    names = ", ".join(p.name for p in skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    return (f"--data {data}: {len(skipped)} file(s) of a type it does not read left out ({names}); it reads "
            f"{', '.join(SUFFIXES)} and datasets save_to_disk folders")


def is_packed(path: Path) -> bool:
    """True when `path` is a folder holding a packed user corpus (its manifest.json has format FORMAT)."""
    m = path / "manifest.json"
    if not (path.is_dir() and m.is_file()):
        return False
    try:
        return json.loads(m.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def decode_utf8(raw: bytes, where: str, errors: EncodingErrors) -> tuple[str, int]:
    """(text, replaced) of a file's bytes: UTF-8 with a leading BOM dropped; `replaced` counts the U+FFFD
    characters `errors="replace"` put in place of invalid bytes (0 under "strict").

    Raises:
        DataInputError: empty or whitespace-only; a NUL byte in the first 8 KiB (binary); invalid UTF-8 under
            "strict" (the message gives the byte offset, and the line for a line-oriented file).
    """
    if not raw.strip():
        raise DataInputError(f"{where}: empty file")
    nul = raw.find(b"\x00", 0, BINARY_PROBE)
    if nul >= 0:
        raise DataInputError(f"{where}: binary file (NUL byte at byte offset {nul}), not text")
    skip = len(BOM) if raw.startswith(BOM) else 0
    try:
        return raw[skip:].decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if errors == "strict":
            off = skip + e.start
            line = raw.count(b"\n", 0, off) + 1
            raise DataInputError(f"{where}: invalid UTF-8 at byte offset {off} (line {line}); "
                                 "--encoding-errors replace reads it with U+FFFD") from None
    text = raw[skip:].decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


@dataclass
class ReadStats:
    """Counts of one input read: documents kept, empty texts skipped, U+FFFD replacements."""

    documents: int = 0
    empty: int = 0
    replaced: int = 0


def _field(obj: object, field: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise DataInputError(f"{where}: a JSON {type(obj).__name__}, not an object with field {field!r}")
    if field not in obj:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise DataInputError(f"{where}: no field {field!r} (fields: {keys}); pick one with --text-field")
    value = obj[field]
    if not isinstance(value, str):
        raise DataInputError(f"{where}: field {field!r} is a JSON {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone "\ud800"-style escape: no UTF-8 text a tokenizer can take
        raise DataInputError(f"{where}: field {field!r} holds an unpaired surrogate escape at character "
                             f"{e.start}") from None
    return value


def _json_why(e: json.JSONDecodeError) -> str:
    """json's reason without its trailing "starting at" (e.g. "Unterminated string starting at"): the message adds
    " at column N" itself, which would read "starting at at column N"."""
    return e.msg.removesuffix(" at").removesuffix(" starting")


def _json_lines(text: str, where: str, field: str) -> Iterator[str]:
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit inside a JSON string
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataInputError(f"{where}:{n}: line {n} is not JSON ({_json_why(e)} at column {e.colno})") from None
        yield _field(obj, field, f"{where}:{n}")


def _json(text: str, where: str, field: str) -> Iterator[str]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several values: JSON lines (what datasets' to_json writes)
            yield from _json_lines(text, where, field)
            return
        raise DataInputError(f"{where}:{e.lineno}: not JSON ({_json_why(e)} at line {e.lineno} column {e.colno})") from None
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise DataInputError(f"{where}: a JSON {type(doc).__name__}; expected an array of objects or JSON lines")
    for i, obj in enumerate(doc):
        yield _field(obj, field, f"{where}: record {i}")


def _arrow_texts(table_batches: Iterator, where: str, field: str, schema) -> Iterator[str]:
    import pyarrow as pa

    if field not in schema.names:
        raise DataInputError(f"{where}: no column {field!r} (columns: {', '.join(schema.names)}); "
                             "pick one with --text-field")
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
        raise DataInputError(f"{where}: column {field!r} holds {typ}, not strings")
    row = 0
    for batch in table_batches:  # pyarrow RecordBatches or Tables
        col = batch.column(field)
        if col.null_count:
            first = row + next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
            raise DataInputError(f"{where}: row {first}: column {field!r} is null")
        yield from col.to_pylist()
        row += len(col)


def _parquet(path: Path, where: str, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataInputError(f"{where}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if pf.metadata.num_rows == 0:
        raise DataInputError(f"{where}: empty file (no rows)")
    schema = pf.schema_arrow
    try:
        yield from _arrow_texts(pf.iter_batches(columns=[field] if field in schema.names else None), where,
                                field, schema)
    except pa.ArrowInvalid as e:  # e.g. invalid UTF-8 in a string column
        raise DataInputError(f"{where}: column {field!r} does not read ({str(e).splitlines()[0]})") from None


def _datasets(path: Path, where: str, field: str) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError/ValueError/ArrowInvalid/... for a broken folder
        raise DataInputError(f"{where}: not a readable datasets folder ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0]})") from None
    parts = [(f"{where} [{name}]", d) for name, d in ds.items()] if isinstance(ds, datasets.DatasetDict) \
        else [(where, ds)]
    if sum(len(d) for _, d in parts) == 0:
        raise DataInputError(f"{where}: empty dataset (no rows)")
    for label, d in parts:
        yield from _arrow_texts(d.with_format("arrow").iter(batch_size=8192), label, field, d.data.schema)


def read_documents(inp: InputFile, text_field: str, encoding_errors: EncodingErrors,
                   stats: ReadStats) -> Iterator[str]:
    """The documents of one input, in file order; empty ones are skipped and counted in `stats`.

    Raises:
        DataInputError: as `decode_utf8`; a JSON line/record that is not JSON or lacks the string field
            `text_field` (with its line number); a parquet file or datasets folder without that string column,
            with a null in it, or unreadable.
    """
    where = str(inp.path)
    if inp.kind == "parquet":
        texts: Iterator[str] = _parquet(inp.path, where, text_field)
    elif inp.kind == "datasets":
        texts = _datasets(inp.path, where, text_field)
    else:
        text, stats.replaced = decode_utf8(inp.path.read_bytes(), where, encoding_errors)
        texts = iter([text]) if inp.kind == "txt" else (
            _json_lines(text, where, text_field) if inp.kind == "jsonl" else _json(text, where, text_field))
    for t in texts:
        if t.strip():
            stats.documents += 1
            yield t
        else:
            stats.empty += 1
    if stats.documents == 0:
        raise DataInputError(f"{where}: no non-empty documents ({stats.empty} empty)")
