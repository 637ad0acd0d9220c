"""The batch wire format (wire.batch): round trips, deterministic bytes, and strict rejection of every
malformed `lm/1` / `classifier/1` blob, plus the model-class -> kind -> loss mapping and the fit check."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from trainer.batch_losses import loss_for_kind
from wire.batch import (
    FORMAT_KEY,
    BatchFormatError,
    batch_kind_for_model,
    check_fits,
    decode_batch,
    encode_batch,
)


def classifier_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (3, 5), attention_mask (3, 5) with padding, labels (3,)), int64, as SentimentTask draws them."""
    ids = torch.tensor([[101, 2307, 3185, 102, 0], [101, 2919, 102, 0, 0], [101, 2025, 2919, 2012, 102]])
    mask = (ids != 0).to(torch.int64)
    return ids, mask, torch.tensor([1, 0, 1])


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.arange(18, dtype=torch.int64).reshape(2, 9) % 50
    return tokens[:, :-1], tokens[:, 1:]  # non-contiguous views, as get_batch's slices can be


def raw(tensors: dict[str, torch.Tensor], tag: str | None = "classifier/1", **extra: str) -> bytes:
    """A safetensors blob with arbitrary tensors and metadata (what a buggy or hostile trainer could upload)."""
    meta = ({FORMAT_KEY: tag} if tag else {}) | extra
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta or None)


def test_round_trips_are_exact_and_bytes_deterministic():
    b = classifier_batch()
    data = encode_batch(b, "classifier")
    assert data == encode_batch(tuple(t.clone() for t in b), "classifier")  # stable content hash
    n = struct.unpack("<Q", data[:8])[0]
    assert json.loads(data[8:8 + n])["__metadata__"] == {FORMAT_KEY: "classifier/1"}
    got = decode_batch(data, "classifier")
    assert len(got) == 3 and all(torch.equal(a, g) and g.dtype == torch.int64 for a, g in zip(b, got))
    assert all(torch.equal(a, g) for a, g in zip(b, decode_batch(data)))  # kind from the tag
    x, y = lm_batch()
    gx, gy = decode_batch(encode_batch((x, y)), "lm")
    assert torch.equal(gx, x) and torch.equal(gy, y)
    window = torch.arange(9, dtype=torch.int64).reshape(1, 9)  # one row: x and y share one storage
    assert torch.equal(decode_batch(encode_batch((window[:, :-1], window[:, 1:])))[1], window[:, 1:])


def test_encode_refuses_what_decode_would_refuse():
    ids, mask, labels = classifier_batch()
    with pytest.raises(TypeError):
        encode_batch((ids, mask), "classifier")
    with pytest.raises(TypeError):
        encode_batch((ids, mask.to(torch.int32), labels), "classifier")
    with pytest.raises(BatchFormatError, match="labels"):
        encode_batch((ids, mask, labels[:2]), "classifier")
    with pytest.raises(ValueError, match="unknown batch kind"):
        encode_batch((ids, mask, labels), "regression")  # type: ignore[arg-type]


def _bad_blobs() -> dict[str, bytes]:
    ids, mask, labels = classifier_batch()
    good = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    x, y = lm_batch()
    blob = encode_batch((ids, mask, labels), "classifier")
    return {
        "not safetensors": b"definitely not a batch",
        "empty": b"",
        "header length past the end": struct.pack("<Q", 1 << 40) + b"{}",
        "truncated data": blob[:-7],
        "unversioned (no metadata)": raw(good, tag=None),
        "future version": raw(good, tag="classifier/2"),
        "unknown kind": raw(good, tag="regression/1"),
        "extra metadata": raw(good, note="hi"),
        "missing tensor": raw({"input_ids": ids, "labels": labels}),
        "extra tensor": raw({**good, "token_type_ids": torch.zeros_like(ids)}),
        "int32 ids": raw({**good, "input_ids": ids.to(torch.int32)}),
        "float labels": raw({**good, "labels": labels.float()}),
        "mask shape": raw({**good, "attention_mask": mask[:, :4]}),
        "labels per token": raw({**good, "labels": mask.clone()}),
        "labels count": raw({**good, "labels": torch.tensor([1, 0])}),
        "mask value 2": raw({**good, "attention_mask": mask * 2}),
        "row attends nothing": raw({**good, "attention_mask": mask * torch.tensor([[1], [0], [1]])}),
        "negative label": raw({**good, "labels": torch.tensor([1, -1, 0])}),
        "negative id": raw({**good, "input_ids": -ids}),
        "zero tokens": raw({"input_ids": ids[:, :0], "attention_mask": mask[:, :0], "labels": labels}),
        "zero rows": raw({"input_ids": ids[:0], "attention_mask": mask[:0], "labels": labels[:0]}),
        "lm tensors under a classifier tag": raw({"x": x, "y": y}),
        "lm y shape": raw({"x": x, "y": y[:, :3]}, tag="lm/1"),
    }


@pytest.mark.parametrize("name", sorted(_bad_blobs()))
def test_malformed_blobs_are_rejected_with_a_reason(name):
    with pytest.raises(BatchFormatError) as exc:
        decode_batch(_bad_blobs()[name])
    assert isinstance(exc.value, ValueError) and len(str(exc.value)) > 10


def test_a_batch_of_the_other_kind_is_rejected():
    with pytest.raises(BatchFormatError, match="expected a classifier/1 batch.*lm/1"):
        decode_batch(encode_batch(lm_batch()), "classifier")
    with pytest.raises(BatchFormatError, match="expected a lm/1 batch"):
        decode_batch(encode_batch(classifier_batch(), "classifier"), "lm")


def test_kind_and_loss_follow_the_model_class():
    assert batch_kind_for_model("BertForSequenceClassification") == "classifier"
    assert batch_kind_for_model("GPT2LMHeadModel") == batch_kind_for_model("LlamaForCausalLM") == "lm"
    with pytest.raises(ValueError, match="no probe loss"):
        batch_kind_for_model("BertModel")
    from trainer.sentiment import classifier_loss
    from trainer.train import lm_batch_loss

    assert loss_for_kind("classifier") is classifier_loss and loss_for_kind("lm") is lm_batch_loss


def test_check_fits_refuses_ids_positions_and_labels_the_model_lacks():
    cfg = BertConfig(vocab_size=4000, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=5, num_labels=2)
    with torch.random.fork_rng(devices=[]):
        bert = BertForSequenceClassification(cfg)
    ids, mask, labels = classifier_batch()
    check_fits(bert, "classifier", (ids, mask, labels))
    with pytest.raises(BatchFormatError, match="vocabulary"):
        check_fits(bert, "classifier", (ids + 4000, mask, labels))
    with pytest.raises(BatchFormatError, match="positions"):
        check_fits(bert, "classifier", (torch.cat([ids, ids], 1), torch.cat([mask, mask], 1), labels))
    with pytest.raises(BatchFormatError, match="labels"):
        check_fits(bert, "classifier", (ids, mask, torch.tensor([1, 2, 0])))
    with torch.random.fork_rng(devices=[]):
        gpt = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    x, y = lm_batch()
    check_fits(gpt, "lm", (x, y))
    with pytest.raises(BatchFormatError, match="vocabulary"):
        check_fits(gpt, "lm", (x, y + 50))  # the targets count too
