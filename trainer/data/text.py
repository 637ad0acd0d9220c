"""Pure text clean-up shared by the corpus and task builders (no I/O)."""

from __future__ import annotations

import hashlib
import re
import unicodedata

# Project Gutenberg wrappers, modern ("*** START OF THE PROJECT GUTENBERG EBOOK X ***") and the 1990s
# "small print" header; the licence text sits outside these markers.
_FLAGS = re.MULTILINE | re.IGNORECASE
_PG_START = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$", _FLAGS)
_PG_END = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^End of (?:the )?Project Gutenberg'?s? .*$", _FLAGS)
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")
_WS = re.compile(r"\s+")


def decode_text(raw: bytes) -> str:
    """Decode file bytes: UTF-8 (a leading BOM dropped), else Windows-1252, else Latin-1 (never fails)."""
    for enc in ("utf-8-sig", "cp1252"):
        try:
            return raw.decode(enc)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START marker) and footer (from its END marker).

    Text without the markers is returned unchanged.
    """
    start = _PG_START.search(text)
    if start:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def normalize_text(text: str) -> str:
    """Canonical prose: `\\r\\n`/`\\r` -> `\\n`, Unicode NFC, BOMs removed, Gutenberg wrapper stripped,
    trailing spaces removed, runs of blank lines collapsed to one, outer whitespace stripped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    text = unicodedata.normalize("NFC", text)
    text = strip_gutenberg(text)
    text = _TRAILING_WS.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()


def dedupe_key(text: str) -> str:
    """Key under which two texts count as duplicates: NFC, casefolded, whitespace runs -> one space."""
    return _WS.sub(" ", unicodedata.normalize("NFC", text)).strip().casefold()


def unit_hash(key: str) -> float:
    """A deterministic pseudo-uniform number in [0, 1) from a string (first 8 bytes of blake2b)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
