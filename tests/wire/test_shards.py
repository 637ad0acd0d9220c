"""wire.shards: zero-copy shard streams are byte-identical to safetensors.torch.save; the parse is its inverse."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from safetensors.torch import load, save

from fleet.publisher import write_shards
from trainer.models.gpt2 import build_model
from wire.shards import parse_safetensors, plan_shard, plan_shards


def _named(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [("z.last", torch.randn(5, 7, generator=g).to(dtype)), ("a.first", torch.randn(3, generator=g).to(dtype)),
            ("m.mid", torch.randn(2, 2, 2, generator=g).to(dtype)), ("e.empty", torch.zeros(0, 4, dtype=dtype)),
            ("s.scalar", torch.tensor(1.5, dtype=dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stream_equals_safetensors_save(dtype):
    named = _named(dtype)
    plan = plan_shard(named)
    ref = save(dict(named))
    assert plan.to_bytes() == ref
    assert plan.nbytes == len(ref)
    assert plan.sha256() == hashlib.sha256(ref).hexdigest()
    # small chunks: the same bytes in the same order
    assert b"".join(plan.chunks(chunk_bytes=3)) == ref


def test_model_shards_equal_write_shards_and_hash_alike():
    model = build_model("gpt2-tiny")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    plans = plan_shards(named, shard_bytes=200_000)
    ref = write_shards(model, 200_000)
    assert [n for n, _ in plans] == [n for n, _ in ref] and len(ref) > 2
    assert [p.to_bytes() for _, p in plans] == [b for _, b in ref]
    assert [p.sha256() for _, p in plans] == [hashlib.sha256(b).hexdigest() for _, b in ref]


def test_parse_is_the_inverse_and_aliases_the_buffer():
    named = _named()
    buf = bytearray(save(dict(named)))
    got = parse_safetensors(buf)
    want = load(bytes(buf))
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    # views, not copies: a change to the buffer shows in the tensor
    off = 8 + struct.unpack("<Q", bytes(buf[:8]))[0] + 0  # "a.first" is first in file order
    buf[off:off + 4] = struct.pack("<f", 42.0)
    assert float(got["a.first"][0]) == 42.0
    # a uint8 tensor buffer (e.g. pinned) parses the same
    t = torch.frombuffer(bytearray(save(dict(named))), dtype=torch.uint8)
    assert torch.equal(parse_safetensors(t)["z.last"], dict(named)["z.last"])


@pytest.mark.parametrize("corrupt", ["short", "huge_header", "not_json", "gap", "overlap", "shape", "dtype", "tail"])
def test_parse_rejects_malformed_files(corrupt):
    import json

    a, b = torch.ones(4), torch.zeros(2)
    meta = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}
    data = a.numpy().tobytes() + b.numpy().tobytes()
    if corrupt == "gap":
        meta["b"]["data_offsets"] = [20, 28]
        data += b"\0" * 4
    elif corrupt == "overlap":
        meta["b"]["data_offsets"] = [8, 16]
    elif corrupt == "shape":
        meta["b"]["shape"] = [3]
    elif corrupt == "dtype":
        meta["b"]["dtype"] = "Q9"
    elif corrupt == "tail":
        data += b"\0" * 8
    head = json.dumps(meta).encode()
    if corrupt == "not_json":
        head = b"{not json" + b" " * 7
    buf = struct.pack("<Q", len(head)) + head + data
    if corrupt == "short":
        buf = buf[:5]
    elif corrupt == "huge_header":
        buf = struct.pack("<Q", 1 << 40) + buf[8:]
    with pytest.raises(ValueError):
        parse_safetensors(bytearray(buf))


def test_plan_rejects_mixed_dtypes_and_repeats():
    with pytest.raises(ValueError, match="one dtype"):
        plan_shard([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="repeat"):
        plan_shard([("a", torch.ones(2)), ("a", torch.ones(3))])


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [float("inf")], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [0, float("inf")]},
    {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": "08"},
    {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]},
    {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]},
    "not an entry",
])
def test_parse_rejects_ill_typed_entries_with_value_error(entry):
    import json

    head = json.dumps({"t": entry}).encode()
    with pytest.raises(ValueError):
        parse_safetensors(bytearray(struct.pack("<Q", len(head)) + head + b"\0" * 8))


def test_parse_rejects_deeply_nested_headers_and_non_utf8():
    deep = b"[" * 200_000
    with pytest.raises(ValueError):
        parse_safetensors(bytearray(struct.pack("<Q", len(deep)) + deep))
    head = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.encode("utf-16")
    with pytest.raises(ValueError):
        parse_safetensors(bytearray(struct.pack("<Q", len(head)) + head + b"\0" * 4))


def test_non_ascii_names_stream_the_same_bytes_as_save():
    named = [("é.poids", torch.ones(2)), ("a", torch.zeros(1))]
    assert plan_shard(named).to_bytes() == save(dict(named))
    assert torch.equal(parse_safetensors(bytearray(save(dict(named))))["é.poids"], torch.ones(2))
