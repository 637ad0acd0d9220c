"""trainer.data.tokenizer_for: a preset's tiktoken GPT-2 and a transformers folder's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.user_data import hf_tokenizer_dir, real_documents
from trainer.data import TokenizerError, token_dtype, tokenizer_for


def test_preset_is_gpt2_bpe() -> None:
    tok = tokenizer_for("gpt2-tiny")
    assert (tok.name, tok.vocab_size, tok.eos_id, tok.dtype) == ("gpt2", 50257, 50256, "uint16")
    assert tok.encode_batch(["Hello world", ""]) == [[15496, 995], []]
    # a special token's text inside a document is text, not a document boundary
    assert 50256 not in tok.encode_batch(["a <|endoftext|> b"])[0]
    assert tokenizer_for("gpt2-small").sha256 == tok.sha256 and len(tok.sha256) == 64


def test_folder_tokenizer_matches_the_tokenizers_library(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = hf_tokenizer_dir(tmp_path / "m", vocab_size=400)
    tok = tokenizer_for(str(folder))
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = real_documents()[:20]
    assert tok.encode_batch(docs) == [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    assert tok.eos_id == ref.token_to_id("<|endoftext|>") == 0
    assert tok.vocab_size == ref.get_vocab_size() == 400
    assert tok.eos_id not in tok.encode_batch(["x <|endoftext|> y"])[0]
    assert all(0 <= i < tok.vocab_size for ids in tok.encode_batch(docs) for i in ids)


def test_sha256_follows_the_tokenizer_files(tmp_path: Path) -> None:
    a = tokenizer_for(str(hf_tokenizer_dir(tmp_path / "a", vocab_size=300)))
    b = tokenizer_for(str(hf_tokenizer_dir(tmp_path / "b", vocab_size=300)))
    assert a.sha256 == b.sha256  # same training, same files: same definition
    c = tokenizer_for(str(hf_tokenizer_dir(tmp_path / "c", vocab_size=301)))
    assert c.sha256 != a.sha256
    cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_for(str(tmp_path / "a")).sha256 != a.sha256


def test_refusals_name_the_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"empty: no tokenizer files"):
        tokenizer_for(str(tmp_path / "empty"))
    with pytest.raises(TokenizerError, match=r"no end-of-text token"):
        tokenizer_for(str(hf_tokenizer_dir(tmp_path / "noeos", vocab_size=300, eos=None)))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"bad: the tokenizer does not load"):
        tokenizer_for(str(tmp_path / "bad"))
    with pytest.raises(TokenizerError, match=r"neither a model preset .* nor a folder"):
        tokenizer_for(str(tmp_path / "absent"))


def test_token_dtype() -> None:
    assert [token_dtype(v) for v in (1, 50257, 65536, 65537, 151_936)] == ["uint16"] * 3 + ["uint32"] * 2
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)
