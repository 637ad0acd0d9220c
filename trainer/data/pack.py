"""A built corpus packed for a machine without registry access (a GPU host; a device call carries <= 64 MiB).

`pack_corpus(name, out)` writes `out/cache/corpora/<name>/manifest.json` and one `<split>.bin.xz` per split
(the uint16 token arrays, xz-compressed: GPT-2 ids of real text compress to ~55-60 %), plus the GPT-2 rank
file under `out/cache/tokenizers/` (export needs it). On the other machine, `SPARECYCLES_CACHE=out/cache`
makes `load_corpus(name)` find the manifest, decompress each `.bin.xz` beside itself on first use and verify
it against the manifest's sha256 (trainer.data.corpus.fetch_corpus) — nothing is downloaded.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path
from typing import Any

from trainer.data.corpus import corpus_dir, corpus_splits, fetch_corpus
from trainer.data.sources import atomic_write
from trainer.data.tokenizer import gpt2_ranks_path

XZ_PRESET = 6  # xz -6: the default; -9 gains ~1 % on token ids for 3x the memory


def pack_corpus(name: str, out: Path, *, progress: bool = False, preset: int = XZ_PRESET) -> dict[str, Any]:
    """Build (or verify) corpus `name` and write its packed form under `out/cache/` (see the module doc).

    Returns {"dir": packed corpus folder, "files": {file name: bytes}, "total_bytes": int, "tokens":
    {split: tokens}}. An existing packed file is rewritten (a pack is cheap next to a build).

    Raises:
        ValueError: unknown corpus name.
        trainer.data.sources.DataFetchError: the corpus could not be built.
    """
    manifest = fetch_corpus(name, progress=progress)
    src = corpus_dir(name)
    dest = Path(out) / "cache" / "corpora" / name
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, int] = {}
    for split in corpus_splits(name):
        fname = manifest["splits"][split]["file"]
        data = lzma.compress((src / fname).read_bytes(), preset=preset)
        atomic_write(dest / f"{fname}.xz", data)
        files[f"{fname}.xz"] = len(data)
        (dest / fname).unlink(missing_ok=True)  # a stale .bin would shadow the new .xz
    atomic_write(dest / "manifest.json", json.dumps(manifest, indent=2).encode())
    files["manifest.json"] = (dest / "manifest.json").stat().st_size
    tok = Path(out) / "cache" / "tokenizers"
    tok.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(gpt2_ranks_path(), tok / "gpt2.tiktoken")
    files["tokenizers/gpt2.tiktoken"] = (tok / "gpt2.tiktoken").stat().st_size
    return {"dir": str(dest), "files": files, "total_bytes": sum(files.values()),
            "tokens": {s: manifest["splits"][s]["tokens"] for s in corpus_splits(name)}}
