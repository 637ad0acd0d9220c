"""`sparecycles bench data-pack`: tokenization throughput and the time to pack a text folder with `--data`.

The text is real: the documents of the bundled classics-small corpus (Shakespeare, Milton, the King James Bible;
GPT-2 tokens decoded back to text), written as a folder of `.txt` files until it holds `--size-mb` MB. The corpus
has ~12 MB of text, so a larger folder repeats each document with its paragraphs in another seeded order (copy k
of a document: the same words, a distinct text, so none is dropped as a duplicate).

Measured: (1) tokens/s of GPT-2 BPE (tiktoken, the presets' tokenizer) on one sample of the folder's text with 1
thread and with every core; (2) the cold pack of the whole folder (`trainer.data.user.load_user_corpus` into an
empty cache: hash, read, split, tokenize, write) and the warm one (a cache hit: the inputs hashed again). The
machine's load average is recorded before and after: other processes share the cores.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_CHARS = 8_000_000  # characters tokenized per throughput figure


def _documents() -> list[str]:
    from trainer.data import load_corpus
    from trainer.data.tokenizer import EOT, gpt2_encoding

    corpus = load_corpus("classics-small")
    enc = gpt2_encoding()
    docs: list[str] = []
    for arr in (corpus.train, corpus.val):
        ids = np.asarray(arr, dtype=np.int64)
        ends = np.flatnonzero(ids == EOT)
        start = 0
        for end in ends:
            if end > start:
                docs.append(enc.decode(ids[start:end].tolist()))
            start = end + 1
    return docs


def write_folder(folder: Path, size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Write .txt files of real text (module doc) into `folder` until they hold >= `size_bytes` bytes.
    Returns {"files", "bytes", "source_documents"}."""
    docs = _documents()
    rng = np.random.Generator(np.random.Philox(key=seed))
    folder.mkdir(parents=True, exist_ok=True)
    total, n, copy = 0, 0, 0
    while total < size_bytes:
        for i, doc in enumerate(docs):
            paras = doc.split("\n\n")
            text = doc if copy == 0 else "\n\n".join(paras[j] for j in rng.permutation(len(paras)))
            if copy and text == doc:
                text = f"{doc}\n\n(copy {copy})"
            data = text.encode("utf-8")
            (folder / f"c{copy:02d}-d{i:04d}.txt").write_bytes(data)
            total += len(data)
            n += 1
            if total >= size_bytes:
                break
        copy += 1
    return {"files": n, "bytes": total, "source_documents": len(docs)}


def tokenize_throughput(folder: Path) -> dict[str, Any]:
    """GPT-2 BPE tokens/s on the first SAMPLE_CHARS characters of the folder's files (in pieces of <= 64 Ki
    characters, as the packer batches them), 1 thread vs every core (tiktoken's threads release the GIL)."""
    from trainer.data.tokenizer import gpt2_encoding

    texts, chars = [], 0
    for p in sorted(folder.iterdir()):
        texts.append(p.read_text(encoding="utf-8"))
        chars += len(texts[-1])
        if chars >= SAMPLE_CHARS:
            break
    from trainer.data.user import cut_pieces

    texts = [p for t in texts for p in cut_pieces(t, 65536)]  # balanced work for the threads
    enc = gpt2_encoding()
    out: dict[str, Any] = {"sample_chars": chars, "sample_texts": len(texts)}
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        t0 = time.perf_counter()
        tokens = sum(map(len, enc.encode_ordinary_batch(texts, num_threads=threads)))
        dt = time.perf_counter() - t0
        out[f"threads_{threads}"] = {"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt)}
    return out


def run(size_mb: float, model: str, workdir: Path | None, out: Path | None) -> dict[str, Any]:
    """The whole benchmark (module doc); writes the result JSON to `out` when given and returns it."""
    from trainer.data.user import USER_SPLITS, load_user_corpus

    tmp = Path(tempfile.mkdtemp(prefix="data-pack-", dir=workdir))
    try:
        load_before = os.getloadavg()
        folder = tmp / "texts"
        written = write_folder(folder, int(size_mb * 1e6))
        throughput = tokenize_throughput(folder)
        cache = tmp / "cache"
        (cache / "tokenizers").mkdir(parents=True)
        from trainer.data.tokenizer import gpt2_ranks_path

        shutil.copyfile(gpt2_ranks_path(), cache / "tokenizers" / "gpt2.tiktoken")
        old = os.environ.get("SPARECYCLES_CACHE")
        os.environ["SPARECYCLES_CACHE"] = str(cache)
        try:
            cold: dict[str, float] = {}
            t0 = time.perf_counter()
            corpus = load_user_corpus(str(folder), model, timings=cold)
            cold["total_s"] = time.perf_counter() - t0
            warm: dict[str, float] = {}
            t0 = time.perf_counter()
            load_user_corpus(str(folder), model, timings=warm, progress=False)
            warm["total_s"] = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("SPARECYCLES_CACHE", None)
            else:
                os.environ["SPARECYCLES_CACHE"] = old
        m = corpus.manifest
        tokens = sum(m["splits"][s]["tokens"] for s in USER_SPLITS)
        result = {
            "benchmark": "data_pack",
            "command": f"sparecycles bench data-pack --size-mb {size_mb:g} --model {model}",
            "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                        "load_avg_1m_before": round(load_before[0], 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
                        "note": "the cores are shared with other processes; the load averages say how busy they were"},
            "folder": written,
            "tokenizer": m["tokenizer"]["name"],
            "tokenize_throughput": throughput,
            "pack_cold": {**{k: round(v, 3) for k, v in cold.items()}, "tokens": tokens,
                          "documents": m["documents"], "units": m["units"], "dtype": m["dtype"],
                          "tokens_per_s_tokenize": round(tokens / cold["tokenize_s"]),
                          "mb_per_s_total": round(written["bytes"] / 1e6 / cold["total_s"], 2),
                          "splits": {s: {"tokens": m["splits"][s]["tokens"], "docs": m["splits"][s]["docs"]}
                                     for s in USER_SPLITS}},
            "pack_warm_cache_hit": {k: round(v, 3) for k, v in warm.items()},
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result
