"""classics-large's builder on small pieces (the full fetch, ~65 MB of .debs, stays out of CI): the dictd
parser, the documentation readers, the three-way split, and the packed (xz) form round-tripping through
load_corpus on classics-small."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

import trainer.data.corpus as corpus_mod
from trainer.data import ARTIFACTS, CORPORA, fetch_corpus, load_corpus
from trainer.data.corpus import assign_splits, corpus_splits
from trainer.data.pack import pack_corpus
from trainer.data.reference import (
    dictd_b64 as b64,
)
from trainer.data.reference import (
    doc_documents,
    gcide_documents,
    gcide_entries,
    gcide_text,
)

_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _enc(n: int) -> str:
    s = ""
    while True:
        s = _DIGITS[n % 64] + s
        n //= 64
        if n == 0:
            return s


def test_dictd_base64_numbers():
    # dictd's own examples from gcide.index: "Acacia vera\trzrx\tIZ"
    assert b64("A") == 0 and b64("/") == 63 and b64("BA") == 64
    assert b64("IZ") == 8 * 64 + 25
    assert b64(_enc(123_456_789)) == 123_456_789
    with pytest.raises(ValueError):
        b64("a-b")


def test_gcide_entries_and_documents_from_a_small_dictionary():
    entries = [
        "Affatuate \\Af*fat\"u*ate\\, v. t.\n   To infatuate. [Obs.] --Milton.\n   [1913 Webster]\n",
        "Affear \\Af*fear\"\\, v. t.\n   To frighten. [Obs.] --Spenser.\n   [1913 Webster]\n",
        "Affect \\Af*fect\"\\, v. t.\n   1. To act upon.\n      [1913 Webster]\n   2. To love.\n   [WordNet 1.5]\n",
    ]
    body = b"00-database-short\n   test\n"
    index = ["00-database-short\tA\t" + _enc(len(body))]
    for head, text in zip(("Affatuate", "Affear", "Affect"), entries, strict=True):
        raw = text.encode()
        index.append(f"{head}\t{_enc(len(body))}\t{_enc(len(raw))}")
        body += raw
    index.append(f"affect\t{index[-1].split(chr(9))[1]}\t{index[-1].split(chr(9))[2]}")  # same span
    got = gcide_entries("\n".join(index))
    assert [e.headword for e in got] == ["Affatuate", "Affear", "Affect"]
    docs = list(gcide_documents(body, got, group=2))
    assert [d[1] for d in docs] == ["gcide/0000-affatuate", "gcide/0001-affect"]
    assert docs[0][2][0] == "Affatuate \\Af*fat\"u*ate\\, v. t.\n   To infatuate. [Obs.] --Milton."
    assert "[WordNet 1.5]" not in docs[1][2][0] and "2. To love." in docs[1][2][0]
    assert gcide_text("   [1913 Webster]\n") == ""
    with pytest.raises(ValueError):
        list(gcide_documents(body[:10], got))


def test_doc_documents_reads_rst_and_gzip():
    files = [("root/a/intro.rst.txt", b"Intro\n=====\n\nText.\n"),
             ("root/b.rst.gz", gzip.compress(b"Kernel\r\ndocs\n")),
             ("root/skip.yaml.gz", gzip.compress(b"k: v")),
             ("other/c.rst.txt", b"not under root"),
             ("root/empty.rst.txt", b"  \n")]
    got = list(doc_documents(files, "d", "root", (".rst.txt", ".rst.gz")))
    assert got == [("d", "d/a/intro", ("Intro\n=====\n\nText.",)), ("d", "d/b", ("Kernel\ndocs",))]


def test_three_way_split_is_disjoint_and_sized():
    ids = [f"doc{i}" for i in range(400)]
    sizes = [1000 + 37 * (i % 11) for i in range(400)]
    which = assign_splits(ids, sizes, ("train", "val", "select"))
    tok = {s: sum(n for d, n in zip(ids, sizes, strict=True) if which[d] == s) for s in ("train", "val", "select")}
    total = sum(sizes)
    assert set(which.values()) == {"train", "val", "select"}
    assert 0.05 <= tok["val"] / total <= 0.05 * 1.25 + 0.01
    assert 0.02 <= tok["select"] / total <= 0.02 * 1.25 + 0.01
    # the two-way split of the other corpora is unchanged by the selection split
    two = assign_splits(ids, sizes, ("train", "val"))
    assert {d for d, s in two.items() if s == "val"} == {d for d, s in which.items() if s == "val"}


def test_classics_large_is_registered_with_pinned_debian_sources():
    assert corpus_splits("classics-large") == ("train", "val", "select")
    assert corpus_splits("classics") == ("train", "val")
    assert set(CORPORA["classics-large"]) >= set(CORPORA["classics"]) | {"gcide", "python-docs", "linux-docs"}
    for key in ("dict-gcide", "python3.11-doc", "linux-doc-6.1"):
        a = ARTIFACTS[key]
        assert a.client == "apt" and len(a.sha256) == 64 and a.size > 1_000_000


def test_pack_round_trips_through_load_corpus(tmp_path, monkeypatch):
    real = load_corpus("classics-small")
    info = pack_corpus("classics-small", tmp_path / "pack", preset=0)  # xz -0: fast; CI checks the format
    packed = tmp_path / "pack" / "cache" / "corpora" / "classics-small"
    assert sorted(p.name for p in packed.iterdir()) == ["manifest.json", "train.bin.xz", "val.bin.xz"]
    assert info["total_bytes"] < 0.75 * 2 * (real.train.size + real.val.size)  # xz pays for itself
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "pack" / "cache"))
    monkeypatch.setattr(corpus_mod, "_build", lambda *a: pytest.fail("a packed corpus must not be rebuilt"))
    there = load_corpus("classics-small")
    assert np.array_equal(there.train, real.train) and np.array_equal(there.val, real.val)
    # a corrupted pack is caught by the manifest's sha256 (and then rebuilt, here refused)
    (packed / "train.bin").unlink()
    m = json.loads((packed / "manifest.json").read_text())
    m["splits"]["train"]["sha256"] = "0" * 64
    (packed / "manifest.json").write_text(json.dumps(m))
    (packed / "train.bin.xz").write_bytes(__import__("lzma").compress(bytes(2 * real.train.size)))
    with pytest.raises(pytest.fail.Exception):
        fetch_corpus("classics-small", progress=False)
