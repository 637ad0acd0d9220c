"""Binary sentiment task: Rotten Tomatoes snippets with mean human ratings, from the vaderSentiment sdist.

Source: `additional_resources/hutto_ICWSM_2014.tar.gz/.../movieReviewSnippets_GroundTruth.txt` in
vaderSentiment==3.3.2 (Hutto & Gilbert, ICWSM 2014): 10,605 lines `id <TAB> mean rating <TAB> text`,
ratings in [-4, 4] averaged over human raters. Label = 1 if rating > 0, 0 if < 0; exactly-zero ratings
are dropped. Duplicate sentences (same `dedupe_key`) are merged by averaging their ratings. Splits are
80/10/10 by `unit_hash` of the sentence key, so a sentence never appears in two splits.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.sources import ARTIFACTS, atomic_write, cache_lock, iter_tar_members, sha256_file
from trainer.data.text import decode_text, dedupe_key, unit_hash
from trainer.paths import cache_dir

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
SPLIT_EDGES = (0.8, 0.9)  # unit_hash < 0.8 -> train, < 0.9 -> val, else test
_INNER_TAR = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_MEMBER = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"

Example = tuple[str, int]


@dataclass(frozen=True)
class SentimentData:
    """train/val/test: tuples of (sentence, label) with label 1 = positive, 0 = negative."""

    train: tuple[Example, ...]
    val: tuple[Example, ...]
    test: tuple[Example, ...]
    manifest: dict[str, Any] = field(repr=False, compare=False)


def task_dir() -> Path:
    """`cache_dir()/tasks/sentiment` (not created)."""
    return cache_dir() / "tasks" / "sentiment"


def parse_ratings(text: str) -> list[tuple[str, float]]:
    """Parse `id<TAB>rating<TAB>sentence` lines into (sentence, rating); blank lines are skipped.

    Raises:
        ValueError: a line without three tab-separated fields or with a non-numeric rating.
    """
    rows = []
    for lineno, line in enumerate(text.replace("\r\n", "\n").split("\n"), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"line {lineno}: expected 3 tab-separated fields, got {len(fields)}")
        rows.append((fields[2].strip(), float(fields[1])))
    return rows


def label_and_split(rows: list[tuple[str, float]]) -> dict[str, list[Example]]:
    """Merge duplicates (mean rating), drop zero means, label by sign, split 80/10/10 by text hash.

    Pure function; output order within a split follows first appearance in `rows`.
    """
    merged: dict[str, list[Any]] = {}
    for text, rating in rows:
        entry = merged.setdefault(dedupe_key(text), [text, 0.0, 0])
        entry[1] += rating
        entry[2] += 1
    out: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for key, (text, total, count) in merged.items():
        mean = total / count
        if mean == 0.0:
            continue
        u = unit_hash(key)
        split = "train" if u < SPLIT_EDGES[0] else "val" if u < SPLIT_EDGES[1] else "test"
        out[split].append((text, int(mean > 0)))
    return out


def _read_source() -> list[tuple[str, float]]:
    (_, inner), = iter_tar_members("vaderSentiment", _INNER_TAR)
    with tarfile.open(fileobj=io.BytesIO(inner), mode="r:gz") as tf:
        f = tf.extractfile(_MEMBER)
        if f is None:
            raise RuntimeError(f"{_MEMBER} missing from {_INNER_TAR}")
        return parse_ratings(decode_text(f.read()))


def _verify(manifest: dict[str, Any]) -> bool:
    if manifest.get("format_version") != FORMAT_VERSION:
        return False
    if manifest.get("source", {}).get("sha256") != ARTIFACTS["vaderSentiment"].sha256:
        return False
    d = task_dir()
    files = {s: d / f"{s}.jsonl" for s in SPLITS}
    return all(p.is_file() and sha256_file(p) == manifest["splits"][s]["sha256"] for s, p in files.items())


def fetch_sentiment(force: bool = False) -> dict[str, Any]:
    """Build (or verify the cached build of) the sentiment task and return its manifest.

    Writes `train.jsonl`, `val.jsonl`, `test.jsonl` (`{"text": str, "label": 0|1}` per line) and
    `manifest.json` (source package/version/sha256, raw/dropped/duplicate counts, per-split sizes,
    positives and sha256) under `task_dir()`. A verifying cache is returned without downloading.

    Raises:
        trainer.data.sources.DataFetchError: the vaderSentiment sdist could not be fetched.
    """
    with cache_lock("task-sentiment"):
        return _fetch_locked(force)


def _fetch_locked(force: bool) -> dict[str, Any]:
    d = task_dir()
    mpath = d / "manifest.json"
    if not force and mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
            if _verify(manifest):
                return manifest
        except (ValueError, KeyError, TypeError):
            pass
    rows = _read_source()
    splits = label_and_split(rows)
    d.mkdir(parents=True, exist_ok=True)
    info = {}
    for s in SPLITS:
        lines = "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in splits[s])
        atomic_write(d / f"{s}.jsonl", lines.encode("utf-8"))
        info[s] = {"file": f"{s}.jsonl", "examples": len(splits[s]),
                   "positives": sum(y for _, y in splits[s]), "sha256": sha256_file(d / f"{s}.jsonl")}
    art = ARTIFACTS["vaderSentiment"]
    unique = len({dedupe_key(t) for t, _ in rows})
    manifest = {
        "format_version": FORMAT_VERSION,
        "task": "sentiment",
        "source": {"package": art.package, "version": art.version, "client": art.client, "sha256": art.sha256,
                   "member": f"{_INNER_TAR}/{_MEMBER}"},
        "raw_sentences": len(rows),
        "duplicates_merged": len(rows) - unique,
        "zero_rating_dropped": unique - sum(v["examples"] for v in info.values()),
        "splits": info,
    }
    atomic_write(mpath, json.dumps(manifest, indent=2).encode())
    return manifest


def load_sentiment() -> SentimentData:
    """Load the sentiment task (building it first if missing or unverifiable).

    Raises:
        trainer.data.sources.DataFetchError: the vaderSentiment sdist could not be fetched.
    """
    manifest = fetch_sentiment()
    d = task_dir()
    parts = {}
    for s in SPLITS:
        with open(d / f"{s}.jsonl", encoding="utf-8") as f:
            parts[s] = tuple((r["text"], int(r["label"])) for r in map(json.loads, f))
    return SentimentData(train=parts["train"], val=parts["val"], test=parts["test"], manifest=manifest)
