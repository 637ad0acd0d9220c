"""`--data`: a user's text in every input format, packed with the model's tokenizer into the corpora's memmaps,
cached by content, split by document; `sparecycles data pack`; and each refusal (one line, exit 2, nothing
half-written). The text is real: sections of the project's own README and DESIGN."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from support.user_data import hf_tokenizer_dir, real_documents, wide_tokenizer_dir, write_formats
from trainer.data import get_batch, iter_eval_batches, tokenizer_for
from trainer.data.tokenizer import gpt2_encoding, gpt2_ranks_path
from trainer.data.user import USER_SPLITS, check_fits, cut_pieces, load_user_corpus
from trainer.data.user_read import DataInputError

DOCS = real_documents()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private SPARECYCLES_CACHE holding the GPT-2 rank file (copied from the real cache: nothing fetched)."""
    ranks = gpt2_ranks_path()
    root = tmp_path / "cache"
    (root / "tokenizers").mkdir(parents=True)
    shutil.copyfile(ranks, root / "tokenizers" / "gpt2.tiktoken")
    monkeypatch.setenv("SPARECYCLES_CACHE", str(root))
    return root


def _arrays(c) -> dict[str, np.ndarray]:
    return {"train": np.asarray(c.train), "val": np.asarray(c.val), "select": np.asarray(c.select)}


def _user_dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "corpora").iterdir()) if (cache / "corpora").is_dir() else []


def test_every_format_packs_the_same_tokens(tmp_path: Path, cache: Path) -> None:
    paths = write_formats(tmp_path / "in", DOCS)
    ref = load_user_corpus(str(paths["txt"]), "gpt2-tiny", progress=False)
    enc = gpt2_encoding()
    # every document once, whole or in pieces, each tokenized by GPT-2; EOS after each document's last piece
    size = ref.manifest["settings"]["piece_chars"]
    expected = sorted(tuple(enc.encode_ordinary(p)) for d in DOCS for p in cut_pieces(d, size))
    arrays = _arrays(ref)
    assert sum(int((a == 50256).sum()) for a in arrays.values()) == len(DOCS) == ref.manifest["documents"]
    assert sum(a.size for a in arrays.values()) == len(DOCS) + sum(map(len, expected))
    assert ref.train.dtype == np.uint16 and (ref.vocab_size, ref.eot) == (50257, 50256)
    assert ref.manifest["tokenizer"]["sha256"] == tokenizer_for("gpt2-tiny").sha256
    for kind, path in paths.items():
        if kind == "txt":
            continue
        c = load_user_corpus(str(path), "gpt2-tiny", progress=False)
        assert c.name != ref.name  # other input files: another cache entry
        for split, arr in _arrays(c).items():
            assert np.array_equal(arr, arrays[split]), (kind, split)
        assert c.manifest["documents"] == len(DOCS)


def test_splits_are_by_document_and_deterministic(tmp_path: Path, cache: Path, monkeypatch) -> None:
    long_doc = "\n".join(DOCS[40:])  # one large file among small ones: held out in pieces
    docs = [*DOCS[:40], long_doc]
    src = write_formats(tmp_path / "a", docs)["jsonl"]
    c = load_user_corpus(str(src), "gpt2-tiny", progress=False)
    m = c.manifest
    assert m["units"] > len(docs) and {s: m["splits"][s]["docs"] > 0 for s in USER_SPLITS} == dict.fromkeys(
        USER_SPLITS, True)
    total = sum(m["splits"][s]["tokens"] for s in USER_SPLITS)
    assert 0.02 < m["splits"]["val"]["tokens"] / total < 0.09  # VAL_FRACTION 5 %, within 1.25 x
    enc = gpt2_encoding()
    texts = {s: enc.decode(np.asarray(a, dtype=np.int64).tolist()) for s, a in _arrays(c).items()}
    size = m["settings"]["piece_chars"]
    # (a document that also occurs inside another one, e.g. the architecture diagram README.md and DESIGN.md both
    # hold, can be found in two splits: left out)
    short = [d for d in DOCS[:40] if len(d) <= size and sum(d in e for e in DOCS) == 1]
    assert len(long_doc) > 4 * size and len(short) >= 30
    for d in short:  # a document up to the piece size lies whole in exactly one split
        assert sum(d in t for t in texts.values()) == 1
    for p in cut_pieces(long_doc, size):  # and each piece of the long one
        assert sum(p in t for t in texts.values()) == 1
    # reversed input order, another folder, another cache: the same documents land in the same splits
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "cache2"))
    shutil.copytree(cache / "tokenizers", tmp_path / "cache2" / "tokenizers")
    rev = write_formats(tmp_path / "b", docs[::-1])["jsonl"]
    c2 = load_user_corpus(str(rev), "gpt2-tiny", progress=False)
    texts2 = {s: enc.decode(np.asarray(a, dtype=np.int64).tolist()) for s, a in _arrays(c2).items()}
    assert {s: c2.manifest["splits"][s]["tokens"] for s in USER_SPLITS} == {
        s: m["splits"][s]["tokens"] for s in USER_SPLITS}
    for d in short:
        assert [d in texts2[s] for s in USER_SPLITS] == [d in texts[s] for s in USER_SPLITS]
    again = load_user_corpus(str(src), "gpt2-tiny", progress=False)  # built again from scratch in cache2
    assert {s: again.manifest["splits"][s]["sha256"] for s in USER_SPLITS} == {
        s: m["splits"][s]["sha256"] for s in USER_SPLITS}


def test_cache_hit_and_rebuild_on_change(tmp_path: Path, cache: Path) -> None:
    folder = write_formats(tmp_path / "in", DOCS[:30])["txt"]
    c = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    d = cache / "corpora" / c.name
    stamp = (d / "manifest.json").stat().st_mtime_ns
    hit = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    assert hit.name == c.name and (d / "manifest.json").stat().st_mtime_ns == stamp
    assert [f["name"] for f in c.manifest["files"]] == sorted(p.name for p in folder.iterdir())
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in c.manifest["files"])
    (folder / "0003.txt").write_text(DOCS[3] + "\nOne more line.", encoding="utf-8")
    changed = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    assert changed.name != c.name
    assert sum(a.size for a in _arrays(changed).values()) > sum(a.size for a in _arrays(c).values())
    # another tokenizer is another build
    tok_dir = hf_tokenizer_dir(tmp_path / "model", vocab_size=400)
    other = load_user_corpus(str(folder), str(tok_dir), progress=False)
    assert other.name != changed.name and other.vocab_size == 400 and other.eot == 0
    assert int(max(a.max() for a in _arrays(other).values())) < 400
    # a corrupt cached split is rebuilt, not read
    want = np.array(changed.val)
    bad = cache / "corpora" / changed.name / "val.bin"
    bad.write_bytes(b"\x00\x00" * (bad.stat().st_size // 2))
    fixed = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    assert np.array_equal(np.asarray(fixed.val), want) and want.max() > 0
    assert not [n for n in _user_dirs(cache) if n.startswith(".")]


def test_uint32_for_a_vocabulary_above_65536(tmp_path: Path, cache: Path) -> None:
    folder = write_formats(tmp_path / "in", DOCS[:30])["txt"]
    tok_dir = wide_tokenizer_dir(tmp_path / "wide", DOCS[:30])
    c = load_user_corpus(str(folder), str(tok_dir), progress=False)
    assert c.train.dtype == np.uint32 and c.manifest["dtype"] == "uint32" and c.vocab_size == 70_000
    top = int(c.train.max())
    assert top > 65_535 and top < 70_000
    x, y = get_batch(c.train, 4, 16, seed=0, index=0)
    assert int(x.max()) > 65_535 and np.array_equal(y[:, :-1].numpy(), x[:, 1:].numpy())
    xs = [xb for xb, _ in iter_eval_batches(c.val, 2, 16, max_batches=1)]
    assert xs[0].dtype == torch.int64 and int(xs[0].max()) > 65_535
    d = cache / "corpora" / c.name
    assert (d / "train.bin").stat().st_size == 4 * c.manifest["splits"]["train"]["tokens"]


def test_pack_for_a_machine_without_the_files(tmp_path: Path, cache: Path, monkeypatch) -> None:
    from trainer.cli import data_app

    folder = write_formats(tmp_path / "in", DOCS[:30])["txt"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    res = CliRunner().invoke(data_app, ["pack", "--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        f"error: {tmp_path / 'bad.jsonl'}:2: no field 'text' (fields: 'body'); pick one with --text-field"]
    assert not (tmp_path / "out").exists() and not _user_dirs(cache)
    res = CliRunner().invoke(data_app, ["pack", "--data", str(folder), "--model", "gpt2-tiny",
                                        "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    packed = next((tmp_path / "out").iterdir())
    assert sorted(p.name for p in packed.iterdir()) == ["manifest.json", "select.bin.xz", "train.bin.xz", "val.bin.xz"]
    built = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    # the other machine: a fresh cache, no input files
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "other"))
    shutil.copytree(cache / "tokenizers", tmp_path / "other" / "tokenizers")
    shutil.rmtree(folder)
    there = load_user_corpus(str(packed), "gpt2-tiny", progress=False)
    for s, a in _arrays(built).items():
        assert np.array_equal(_arrays(there)[s], a)
    with pytest.raises(DataInputError, match=r"packed with tokenizer gpt2 .* pack it again with --model"):
        load_user_corpus(str(packed), str(hf_tokenizer_dir(tmp_path / "m", vocab_size=300)), progress=False)


def _refusal(cache: Path, data: str, match: str, **kw) -> None:
    with pytest.raises(DataInputError, match=match) as info:
        load_user_corpus(data, "gpt2-tiny", progress=False, **kw)
    assert "\n" not in str(info.value)
    assert not _user_dirs(cache), "nothing half-written in the cache"


def test_refusals_name_the_file_line_and_field(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "notes.csv").write_text("a,b\n")
    _refusal(cache, str(tmp_path / "none"), r"none: the folder holds no text files")
    _refusal(cache, str(tmp_path / "absent"), r"absent: no such file or folder")
    _refusal(cache, str(tmp_path / "none" / "*.txt"), r"the pattern matches no input files")
    (tmp_path / "empty.txt").write_text("  \n\n")
    _refusal(cache, str(tmp_path / "empty.txt"), r"empty.txt: empty file")
    (tmp_path / "blob.txt").write_bytes(b"PK\x03\x04\x00\x00binary")
    _refusal(cache, str(tmp_path / "blob.txt"), r"blob.txt: binary file \(NUL byte at byte offset 4\)")
    text = "\n".join(DOCS[:5]).encode()
    bad = text[:1000] + b"\xff\xfe" + text[1000:]
    (tmp_path / "latin.txt").write_bytes(bad)
    line = bad.count(b"\n", 0, 1000) + 1
    _refusal(cache, str(tmp_path / "latin.txt"), rf"latin.txt: invalid UTF-8 at byte offset 1000 \(line {line}\); "
             r"--encoding-errors replace")
    rows = [json.dumps({"text": d}) for d in DOCS[:5]]
    (tmp_path / "broken.jsonl").write_text("\n".join([*rows[:3], "{not json", *rows[3:]]))
    _refusal(cache, str(tmp_path / "broken.jsonl"), r"broken.jsonl:4: line 4 is not JSON")
    (tmp_path / "nofield.jsonl").write_text("\n".join([*rows[:2], json.dumps({"body": "x"})]))
    _refusal(cache, str(tmp_path / "nofield.jsonl"), r"nofield.jsonl:3: no field 'text' \(fields: 'body'\)")
    _refusal(cache, str(tmp_path / "nofield.jsonl"), r"nofield.jsonl:1: no field 'content'", text_field="content")
    (tmp_path / "num.jsonl").write_text(json.dumps({"text": 3}))
    _refusal(cache, str(tmp_path / "num.jsonl"), r"num.jsonl:1: field 'text' is a JSON int, not a string")
    (tmp_path / "sur.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    _refusal(cache, str(tmp_path / "sur.jsonl"), r"sur.jsonl:2: field 'text' holds an unpaired surrogate escape")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[:3]}), tmp_path / "p.parquet")
    _refusal(cache, str(tmp_path / "p.parquet"), r"p.parquet: no column 'text' \(columns: body\)")
    (tmp_path / "fake.parquet").write_text("not parquet")
    _refusal(cache, str(tmp_path / "fake.parquet"), r"fake.parquet: not a readable parquet file")
    (tmp_path / "two.jsonl").write_text("\n".join(rows[:2]))
    _refusal(cache, str(tmp_path / "two.jsonl"), r"2 document\(s\) .* at least 3 documents or pieces")


def test_encoding_errors_replace_goes_on(tmp_path: Path, cache: Path) -> None:
    folder = write_formats(tmp_path / "in", DOCS[:20])["txt"]
    raw = (folder / "0002.txt").read_bytes()
    (folder / "0002.txt").write_bytes(raw[:50] + b"\xff" + raw[50:])
    with pytest.raises(DataInputError, match=r"0002.txt: invalid UTF-8 at byte offset 50"):
        load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    c = load_user_corpus(str(folder), "gpt2-tiny", progress=False, encoding_errors="replace")
    entry = next(i for i in c.manifest["inputs"] if i["name"] == "0002.txt")
    assert entry["replaced_chars"] == 1 and c.manifest["settings"]["encoding_errors"] == "replace"


def test_a_corpus_smaller_than_one_batch_is_refused(tmp_path: Path, cache: Path) -> None:
    folder = write_formats(tmp_path / "in", DOCS[:12])["txt"]
    c = load_user_corpus(str(folder), "gpt2-tiny", progress=False)
    n = c.train.shape[0]
    check_fits(c, str(folder), 1, 16)
    with pytest.raises(DataInputError, match=rf"the train split holds {n:,} tokens, fewer than one batch "
                                             rf"\(--batch-size 64 x --seq-len 512 \+ 1 = 32,769"):
        check_fits(c, str(folder), 64, 512)


def test_train_cli_on_user_data_and_its_refusals(tmp_path: Path, cache: Path) -> None:
    from trainer.config import TrainConfig
    from trainer.train import train

    folder = write_formats(tmp_path / "in", DOCS)["jsonl"]
    cfg = TrainConfig(data=str(folder), steps=3, warmup_steps=0, batch_size=4, seq_len=32, eval_every=3,
                      eval_batches=2, run_dir=tmp_path / "run")
    result = train(cfg, progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["corpus"].startswith("user-") and np.isfinite(summary["final_val_loss"]), result
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"] == str(folder)
    with pytest.raises(ValueError, match=r"fewer than one batch"):
        train(cfg.model_copy(update={"batch_size": 4096, "seq_len": 1024, "run_dir": tmp_path / "r2"}),
              progress=False)
    with pytest.raises(ValueError, match="LM task"):
        TrainConfig(data=str(folder), task="sentiment", optimizer="mezo")
    with pytest.raises(ValueError, match="encoding_errors"):
        TrainConfig(data=str(folder), encoding_errors="ignore")
    assert "data" not in TrainConfig().run_json()  # run folders from before --data still resume
