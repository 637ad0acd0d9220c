"""Reference text from Debian packages: Webster's dictionary (GCIDE), the Python and Linux documentation.

Each reader turns one pinned `.deb` (trainer.data.sources.ARTIFACTS) into `Document`s; the parsing is split
into pure functions over bytes/str (`gcide_entries`, `gcide_documents`, `doc_documents`) so the tests run
them on small pieces without fetching hundreds of MB.

- `dict-gcide` ships the dictionary in dictd format: `gcide.index` (`headword TAB offset TAB length`, both
  numbers in dictd's base64: digits `A-Za-z0-9+/` = 0..63, most significant first; dictd's
  `dictzip`/`dictfmt` source, `b64_decode`) and `gcide.dict.dz` (gzip-compatible dictzip of the entries).
  Entries are grouped in offset order, `GCIDE_GROUP` at a time, into one document each, so the held-out
  splits take whole runs of neighbouring headwords. The `[1913 Webster]`-style provenance lines that close
  every sense are dropped (they are not text, and repeat ~200k times).
- `python3.11-doc` and `linux-doc-6.1` ship Sphinx builds whose `_sources/**/*.rst.txt` are the
  reStructuredText sources: one document per file (the Linux package also has the plain `Documentation/`
  tree, the same rst gzipped, plus `.txt` files outside the Sphinx build, which we add).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath
from typing import NamedTuple

from trainer.data.text import decode_text, normalize_text

GCIDE_GROUP = 400  # entries per document (~130k headwords -> ~300 documents)
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUE = {c: i for i, c in enumerate(_B64)}
# A provenance line alone on its line: [1913 Webster], [WordNet 1.5], [PJC], [Webster 1913 Suppl.], ...
_PROVENANCE = re.compile(r"^[ \t]*\[(?:1913 Webster|Webster 1913[^\]]*|WordNet[^\]]*|PJC|RN[^\]]*|"
                         r"Century Dict\.?[^\]]*|Chambers[^\]]*|Shamelessly[^\]]*|[A-Z]{2,4})\][ \t]*$",
                         re.MULTILINE)


class GcideEntry(NamedTuple):
    """One index line of a dictd database: headword and the byte span of its entry in the .dict text."""

    headword: str
    offset: int
    length: int


def dictd_b64(text: str) -> int:
    """Decode a dictd base64 number (digits `A-Za-z0-9+/` = 0..63, most significant first).

    Raises:
        ValueError: empty or holding a character outside the alphabet.
    """
    if not text:
        raise ValueError("empty dictd base64 number")
    value = 0
    for ch in text:
        try:
            value = value * 64 + _B64_VALUE[ch]
        except KeyError:
            raise ValueError(f"{ch!r} is not a dictd base64 digit (in {text!r})") from None
    return value


def gcide_entries(index_text: str) -> list[GcideEntry]:
    """Parse a dictd `.index` into entries sorted by offset, one per distinct span (several headwords may
    share an entry; the first listed names it). Database metadata headwords (`00-database-*`, `00databse*`)
    are skipped.

    Raises:
        ValueError: a line without three tab-separated fields or with a bad number.
    """
    spans: dict[tuple[int, int], str] = {}
    for n, line in enumerate(index_text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 3:
            raise ValueError(f"index line {n} has {len(fields)} tab-separated fields, expected 3: {line[:80]!r}")
        head = fields[0]
        if head.startswith(("00-database", "00database")):
            continue
        spans.setdefault((dictd_b64(fields[1]), dictd_b64(fields[2])), head)
    return [GcideEntry(h, o, n) for (o, n), h in sorted(spans.items())]


def gcide_text(entry_text: str) -> str:
    """One entry's text without its provenance lines, normalised (trainer.data.text.normalize_text)."""
    return normalize_text(_PROVENANCE.sub("", entry_text))


def gcide_documents(dict_bytes: bytes, entries: list[GcideEntry], group: int = GCIDE_GROUP,
                    source: str = "gcide") -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Group consecutive entries into documents: yields `(source, doc_id, parts)`, one part per entry.

    `dict_bytes` is the decompressed `.dict` (UTF-8); `doc_id` is `gcide/<first headword>`, `<index>` of
    the group appended so ids stay unique. Empty entries are dropped.

    Raises:
        ValueError: group < 1, or an entry's span lies outside `dict_bytes`.
    """
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    for g in range(0, len(entries), group):
        chunk = entries[g:g + group]
        parts = []
        for e in chunk:
            if e.offset + e.length > len(dict_bytes):
                raise ValueError(f"entry {e.headword!r} spans [{e.offset}, {e.offset + e.length}) past the "
                                 f"end of the dictionary ({len(dict_bytes)} bytes)")
            text = gcide_text(decode_text(dict_bytes[e.offset:e.offset + e.length]))
            if text:
                parts.append(text)
        if parts:
            yield source, f"{source}/{g // group:04d}-{chunk[0].headword.lower()}", tuple(parts)


def doc_documents(files: Iterable[tuple[str, bytes]], source: str, root: str,
                  suffixes: tuple[str, ...]) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """One document per documentation file: yields `(source, doc_id, (text,))` for files under `root`
    whose name ends in one of `suffixes` (a `.gz` suffix is decompressed first); `doc_id` is
    `<source>/<path below root without the suffix>`. Empty files are skipped."""
    for path, raw in files:
        if not path.startswith(root):
            continue
        name = path[len(root):].lstrip("/")
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None:
            continue
        data = gzip.decompress(raw) if suffix.endswith(".gz") else raw
        text = normalize_text(decode_text(data))
        if text:
            yield source, f"{source}/{PurePosixPath(name.removesuffix(suffix))}", (text,)


# Where each package keeps the files we read (paths relative to the package root).
GCIDE_DIR = "usr/share/dictd"
PYTHON_DOC_ROOT = "usr/share/doc/python3.11/html/_sources"
LINUX_DOC_ROOT = "usr/share/doc/linux-doc-6.1/Documentation"
