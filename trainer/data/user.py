"""A user's text (`--data PATH`, trainer.data.user_read) tokenized with the model's tokenizer and packed into the
corpora's memmap format, cached by content.

Layout under `cache_dir()/corpora/user-<key[:16]>/`: `train.bin`, `val.bin`, `select.bin` (token ids as
`manifest["dtype"]`: uint16, or uint32 when the vocabulary exceeds 65,536 ids; every document ends with the
tokenizer's EOS) and `manifest.json` (the inputs' names, sizes and sha256s, the tokenizer's name and sha256, the
settings, per-split token/document counts and sha256s). The key is the sha256 of the inputs' names and sha256s,
the tokenizer's sha256 and the settings, so any change to an input, the tokenizer or a setting builds a new
folder; a build is written into a temporary folder and renamed into place, so a crash or a refusal leaves
nothing half-written.

Splits are carved by document, as the corpora's (trainer.data.corpus.assign_splits, by characters instead of
tokens so they are chosen before tokenizing): a document's id is the sha256 of its text (identical documents are
kept once, so none sits on both sides of a split); a document longer than the piece size (`piece_chars`: 1 %
of the corpus, at least 4 Ki characters) is cut at line breaks into pieces, each held
out on its own, so one large file still gives validation and selection text. A piece of a document is
tokenized on its own; EOS follows a document's last piece.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import lzma
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.corpus import Corpus, assign_splits
from trainer.data.model_tokenizer import ModelTokenizer, token_dtype, tokenizer_for
from trainer.data.sources import atomic_write, cache_lock, sha256_file
from trainer.data.user_read import (
    FORMAT,
    DataInputError,
    EncodingErrors,
    ReadStats,
    find_inputs,
    is_packed,
    read_documents,
)
from trainer.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
USER_SPLITS = ("train", "val", "select")
MIN_PIECE_CHARS, PIECE_SHARE = 4096, 100  # a document over 1 % of the corpus (and 4 Ki chars) is held out in pieces
BATCH_CHARS = 1 << 24  # characters per encode_batch call (16 Mi: texts enough for every thread)


@dataclass(frozen=True)
class Unit:
    """A held-out unit: a whole document or one piece of a long one; EOS follows it when `last`."""

    uid: str
    text: str
    last: bool


def piece_chars(total_chars: int) -> int:
    """The piece size of a corpus of `total_chars` characters: 1 % of it, at least 4096 characters. Documents
    up to this size are held out whole; a longer one (a book in a folder of articles, one big file) in pieces,
    so the 5 % validation and 2 % selection splits still meet their targets."""
    return max(MIN_PIECE_CHARS, total_chars // PIECE_SHARE)


def cut_pieces(text: str, size: int) -> list[str]:
    """`text` cut into consecutive pieces of at most `size` characters, each ending after a line break where one
    lies in the second half of its window. `"".join(cut_pieces(t, n)) == t`. Pure function."""
    out, start = [], 0
    while len(text) - start > size:
        nl = text.rfind("\n", start + size // 2, start + size)
        end = nl + 1 if nl >= 0 else start + size
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def _units(docs: list[str]) -> tuple[list[Unit], int]:
    size = piece_chars(sum(map(len, docs)))
    units: list[Unit] = []
    for text in docs:
        uid = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
        pieces = cut_pieces(text, size)
        units += [Unit(uid if len(pieces) == 1 else f"{uid}/{k}", p, k == len(pieces) - 1)
                  for k, p in enumerate(pieces)]
    return units, size


def corpus_key(inputs: list[dict[str, Any]], tok: ModelTokenizer, text_field: str,
               encoding_errors: str) -> str:
    """Hex sha256 naming a build: the inputs' names and sha256s, the tokenizer's sha256, the settings and the
    format version (what changes the packed tokens)."""
    ident = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": tok.sha256, "text_field": text_field,
             "encoding_errors": encoding_errors, "inputs": [(i["name"], i["sha256"]) for i in inputs]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _console(progress: bool):
    from rich.console import Console

    return Console(stderr=True, quiet=not progress)


def _hash_inputs(root: Path, inputs, progress: bool) -> list[dict[str, Any]]:
    out = []
    with _console(progress).status(f"hashing {len(inputs)} input(s) under {root}"):
        for inp in inputs:
            for f in inp.files():
                out.append({"name": str(f.relative_to(root)), "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return out


def _verify(d: Path, key: str, tok: ModelTokenizer) -> str | None:
    """Why the build in `d` cannot be used, or None when its manifest and .bin files verify."""
    try:
        m = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest ({e})"
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION or m.get("key") != key:
        return "built by another format version or from other inputs"
    if m["tokenizer"]["sha256"] != tok.sha256:
        return "built with another tokenizer"
    item = np.dtype(m["dtype"]).itemsize
    for split in USER_SPLITS:
        info = m["splits"][split]
        p = d / info["file"]
        if not p.is_file() or p.stat().st_size != item * info["tokens"] or sha256_file(p) != info["sha256"]:
            return f"{info['file']} is missing, or its size or sha256 does not match the manifest"
    return None


def _open(d: Path) -> Corpus:
    m = json.loads((d / "manifest.json").read_text())
    arrays = {s: np.memmap(d / m["splits"][s]["file"], dtype=np.dtype(m["dtype"]), mode="r") for s in USER_SPLITS}
    return Corpus(name=m["name"], train=arrays["train"], val=arrays["val"], vocab_size=m["tokenizer"]["vocab_size"],
                  eot=m["tokenizer"]["eos_id"], manifest=m, select=arrays["select"])


def _read_all(inputs, text_field: str, encoding_errors: EncodingErrors,
              progress: bool) -> tuple[list[str], list[dict[str, Any]], int]:
    docs, seen, per_input, dupes = [], set(), [], 0
    with _console(progress).status("reading") as status:
        for inp in inputs:
            status.update(f"reading {inp.rel}")
            stats = ReadStats()
            for text in read_documents(inp, text_field, encoding_errors, stats):
                h = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
                if h in seen:
                    dupes += 1
                    continue
                seen.add(h)
                docs.append(text)
            if stats.replaced:
                log.warning("%s: %d invalid UTF-8 sequences replaced by U+FFFD", inp.path, stats.replaced)
            per_input.append({"name": inp.rel, "kind": inp.kind, "documents": stats.documents,
                              "empty_skipped": stats.empty, "replaced_chars": stats.replaced})
    return docs, per_input, dupes


def _tokenize_into(units: list[Unit], which: dict[str, str], tok: ModelTokenizer, tmp: Path,
                   progress: bool) -> tuple[dict[str, dict[str, Any]], float]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    dtype = np.dtype(token_dtype(tok.vocab_size))
    files = {s: open(tmp / f"{s}.bin", "wb") for s in USER_SPLITS}  # noqa: SIM115 (closed below)
    counts = {s: {"tokens": 0, "docs": 0} for s in USER_SPLITS}
    total = sum(len(u.text) for u in units)
    t0 = time.perf_counter()
    try:
        with Progress(TextColumn("[bold]tokenizing[/] {task.fields[name]}"), BarColumn(),
                      TextColumn("{task.completed:,.0f}/{task.total:,.0f} chars, {task.fields[tokens]:,} tokens"),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=_console(progress)) as bar:
            task = bar.add_task("tokenize", total=total, name=tok.name, tokens=0)
            lo, done_tokens = 0, 0
            while lo < len(units):
                hi, chars = lo, 0
                while hi < len(units) and (hi == lo or chars + len(units[hi].text) <= BATCH_CHARS):
                    chars += len(units[hi].text)
                    hi += 1
                for u, ids in zip(units[lo:hi], tok.encode_batch([u.text for u in units[lo:hi]]), strict=True):
                    split = which[u.uid]
                    arr = np.asarray(ids + [tok.eos_id] if u.last else ids, dtype=dtype)
                    arr.tofile(files[split])
                    counts[split]["tokens"] += arr.size
                    counts[split]["docs"] += 1
                    done_tokens += arr.size
                bar.update(task, advance=chars, tokens=done_tokens)
                lo = hi
    finally:
        for f in files.values():
            f.close()
    seconds = time.perf_counter() - t0
    return {s: {"file": f"{s}.bin", **counts[s], "sha256": sha256_file(tmp / f"{s}.bin")} for s in USER_SPLITS}, seconds


@contextlib.contextmanager
def _staged(d: Path) -> Iterator[Path]:
    """A temporary folder beside `d` to build it in: when the block ends, it replaces `d` (read-only for others);
    when the block raises, it is removed and `d` is left as it was."""
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}-"))
    try:
        yield tmp
        tmp.chmod(0o755)
        if d.exists():
            shutil.rmtree(d)
        os.rename(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class _Source:
    """What a build reads: the `inputs` found under `root` (find_inputs), their `hashes` (_hash_inputs), the `label`
    the manifest names the corpus by, and how their text is read (`text_field`, `encoding_errors`)."""

    root: Path
    inputs: Any
    hashes: list[dict[str, Any]]
    label: str
    text_field: str
    encoding_errors: EncodingErrors


def _build(d: Path, key: str, src: _Source, tok: ModelTokenizer, progress: bool,
           timings: dict[str, float]) -> dict[str, Any]:
    t0 = time.perf_counter()
    root, text_field, encoding_errors = src.root, src.text_field, src.encoding_errors
    docs, per_input, dupes = _read_all(src.inputs, text_field, encoding_errors, progress)
    timings["read_s"] = time.perf_counter() - t0
    units, size = _units(docs)
    if len(units) < 3:
        raise DataInputError(f"--data {root}: {len(docs)} document(s) in {sum(len(t) for t in docs):,} characters "
                             f"(after {dupes} duplicates); at least 3 documents or pieces are needed to hold out "
                             "validation and selection text")
    which = assign_splits([u.uid for u in units], [len(u.text) for u in units], USER_SPLITS)
    del docs
    with _staged(d) as tmp:
        timings["split_s"] = time.perf_counter() - t0 - timings["read_s"]
        splits, timings["tokenize_s"] = _tokenize_into(units, which, tok, tmp, progress)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": d.name, "label": src.label, "key": key,
            "dtype": token_dtype(tok.vocab_size),
            "tokenizer": {"name": tok.name, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            "settings": {"text_field": text_field, "encoding_errors": encoding_errors, "piece_chars": size,
                         "split_by": "document (sha256 of its text), pieces of long documents; characters"},
            "files": src.hashes, "inputs": per_input, "duplicates_dropped": dupes,
            "documents": sum(i["documents"] for i in per_input) - dupes, "units": len(units),
            "characters": sum(len(u.text) for u in units), "splits": splits,
        }
        atomic_write(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())
    tokens = sum(s["tokens"] for s in splits.values())
    timings["build_s"] = time.perf_counter() - t0
    log.info("packed %s: %d tokens, tokenized in %.1f s (%.0f tokens/s)", d.name, tokens, timings["tokenize_s"],
             tokens / max(timings["tokenize_s"], 1e-9))
    return manifest


def check_fits(corpus: Corpus, data: str, batch_size: int, seq_len: int) -> None:
    """Refuse a user corpus too small for the run: the training split must hold one batch of distinct windows
    (batch_size x seq_len + 1 tokens), validation and selection one window (seq_len + 1) each.

    Raises:
        DataInputError: naming the split, its token count and what it needs.
    """
    for split, arr, need, what in (("train", corpus.train, batch_size * seq_len + 1, "one batch"),
                                   ("validation", corpus.val, seq_len + 1, "one window"),
                                   ("selection", corpus.select, seq_len + 1, "one window")):
        n = 0 if arr is None else int(arr.shape[0])
        if n < need:
            raise DataInputError(f"--data {data}: the {split} split holds {n:,} tokens, fewer than {what} "
                                 f"(--batch-size {batch_size} x --seq-len {seq_len} + 1 = {batch_size * seq_len + 1:,}"
                                 f" tokens for training, --seq-len + 1 = {seq_len + 1:,} for a window); give more text "
                                 "or lower --batch-size / --seq-len")


def _install(src: Path, tok: ModelTokenizer, model: str) -> Corpus:
    """A packed corpus folder (`pack_user_data`'s: .bin or .bin.xz files + manifest) copied into the cache."""
    m = json.loads((src / "manifest.json").read_text())
    if m["tokenizer"]["sha256"] != tok.sha256:
        raise DataInputError(f"{src}: packed with tokenizer {m['tokenizer']['name']} (sha256 "
                             f"{m['tokenizer']['sha256'][:12]}), but --model {model}'s is {tok.name} (sha256 "
                             f"{tok.sha256[:12]}); pack it again with --model {model}")
    d = cache_dir() / "corpora" / m["name"]
    with cache_lock(m["name"]):
        if _verify(d, m["key"], tok) is None:
            return _open(d)
        with _staged(d) as tmp:
            for split in USER_SPLITS:
                name = m["splits"][split]["file"]
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
                elif (src / f"{name}.xz").is_file():
                    (tmp / name).write_bytes(lzma.decompress((src / f"{name}.xz").read_bytes()))
                else:
                    raise DataInputError(f"{src}: neither {name} nor {name}.xz is there")
            shutil.copyfile(src / "manifest.json", tmp / "manifest.json")
            why = _verify(tmp, m["key"], tok)
            if why is not None:
                raise DataInputError(f"{src}: {why}")
    return _open(d)


def load_user_corpus(data: str, model: str, *, text_field: str = "text", encoding_errors: EncodingErrors = "strict",
                     progress: bool = True, force: bool = False, timings: dict[str, float] | None = None) -> Corpus:
    """The user's corpus for a run on `model`: built on first use (or when an input, the tokenizer or a setting
    changed), else opened from the cache.

    Args:
        data: a file, folder or glob of inputs (trainer.data.user_read), or a folder `pack_user_data` wrote.
        model: a model preset or transformers folder (trainer.data.tokenizer_for picks the tokenizer).
        text_field: the JSON field / parquet or datasets column holding the text.
        encoding_errors: "strict" refuses invalid UTF-8; "replace" reads it as U+FFFD (counted in the manifest).
        progress: show a progress bar (stderr). force: rebuild even when the cached build verifies.
        timings: a dict filled with wall seconds per phase (hash_s, and on a build read_s, split_s,
            tokenize_s (its progress bar included), build_s) and "built" (1.0 when built, 0.0 on a cache hit).

    Returns:
        Corpus with `train`, `val`, `select`: read-only memmaps (N,) of `manifest["dtype"]` (uint16/uint32) token
        ids; `vocab_size`/`eot` of the tokenizer; `manifest`.

    Raises:
        DataInputError (ValueError): bad input (one line naming the file, line, field or byte offset).
        trainer.data.TokenizerError (ValueError): the model has no usable tokenizer.
    """
    if encoding_errors not in ("strict", "replace"):
        raise ValueError(f"encoding_errors must be 'strict' or 'replace', got {encoding_errors!r}")
    tok = tokenizer_for(model)
    path = Path(data).expanduser()
    if is_packed(path):
        return _install(path.resolve(), tok, model)
    root, inputs = find_inputs(data)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    hashes = _hash_inputs(root, inputs, progress)
    timings["hash_s"], timings["built"] = time.perf_counter() - t0, 0.0
    key = corpus_key(hashes, tok, text_field, encoding_errors)
    d = cache_dir() / "corpora" / f"user-{key[:16]}"
    with cache_lock(d.name):
        why = "rebuild asked for" if force else _verify(d, key, tok)
        if why is not None:
            if d.exists():
                log.warning("user corpus %s: rebuilding: %s", d.name, why)
            src = _Source(root, inputs, hashes, path.name or str(path), text_field, encoding_errors)
            _build(d, key, src, tok, progress, timings)
            timings["built"] = 1.0
        return _open(d)


def pack_user_data(data: str, model: str, out: Path, *, text_field: str = "text",
                   encoding_errors: EncodingErrors = "strict", progress: bool = True) -> dict[str, Any]:
    """Build (or reuse) the user's corpus and write it into `out/<name>/` for a machine without the inputs:
    `manifest.json` and one xz-compressed `<split>.bin.xz` per split; there, `--data out/<name>` (with the same
    `--model`) installs it into the cache without the inputs.

    Returns {"dir", "files": {name: bytes}, "total_bytes", "tokens": {split: tokens}}.

    Raises:
        as `load_user_corpus`.
    """
    corpus = load_user_corpus(data, model, text_field=text_field, encoding_errors=encoding_errors,
                              progress=progress)
    m = corpus.manifest
    src = cache_dir() / "corpora" / m["name"]
    dest = Path(out) / m["name"]
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, int] = {}
    for split in USER_SPLITS:
        name = m["splits"][split]["file"]
        atomic_write(dest / f"{name}.xz", lzma.compress((src / name).read_bytes(), preset=6))
        files[f"{name}.xz"] = (dest / f"{name}.xz").stat().st_size
        (dest / name).unlink(missing_ok=True)
    atomic_write(dest / "manifest.json", json.dumps(m, indent=2).encode())
    files["manifest.json"] = (dest / "manifest.json").stat().st_size
    return {"dir": str(dest), "files": files, "total_bytes": sum(files.values()),
            "tokens": {s: m["splits"][s]["tokens"] for s in USER_SPLITS}}
