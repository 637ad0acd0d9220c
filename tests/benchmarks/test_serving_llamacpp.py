"""llama.cpp's llama-server (tools/llamacpp.sh's CPU build) behind the load proxy, as `bench serving --engine llamacpp`
starts it (benchmarks.serving_llamacpp): SmolLM2-135M's GGUF served, its stream passed through unchanged, /load
counting the request while it is answered; and the bench's options for it. Without the build the engine test skips,
naming the command (the README's test command builds it: tools/test_services.sh)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pydantic
import pytest

from api.server import free_port
from benchmarks.serving_llamacpp import LlamaCppProcess, default_gguf, llamacpp_binary
from benchmarks.serving_options import ServingBench
from probe_worker.engine import EngineError


def _binary():
    try:
        return llamacpp_binary()
    except EngineError as exc:
        pytest.skip(f"needs llama-server (bash tools/llamacpp.sh fetch && bash tools/llamacpp.sh build): {exc}")


def _lines(client: httpx.Client, url: str, body: dict) -> list[str]:
    with client.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        return [ln for ln in reply.iter_lines() if ln.startswith("data: ")]


def test_llama_server_behind_the_proxy_streams_and_shows_its_load(tmp_path):
    binary = _binary()
    engine = LlamaCppProcess(binary, default_gguf(), free_port(), tmp_path / "engine.log", extra_args=["-t", "1"])
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    try:
        engine.start()
        engine.wait_ready()
        with httpx.Client(timeout=120) as client:
            assert client.get(engine.url + "/load").json() == {"server_load": 0}
            assert client.get(engine.url + "/v1/models").json()["data"][0]["id"]
            via, direct = _lines(client, engine.url, body), _lines(client, engine.engine_url, body)
            assert via[-1] == direct[-1] == "data: [DONE]"
            texts = [[(json.loads(ln[6:])["choices"] or [{}])[0].get("text", "") for ln in lines[:-1]]
                     for lines in (via, direct)]
            assert texts[0] == texts[1] and len("".join(texts[0])) > 0  # greedy: the same 8 tokens either way
            seen = []
            long = threading.Thread(target=_lines, args=(client, engine.url, {**body, "max_tokens": 256}))
            long.start()
            while long.is_alive():
                seen.append(client.get(engine.url + "/load").json()["server_load"])
            long.join()
            assert 1 in seen and set(seen) <= {0, 1}
            deadline = time.monotonic() + 60  # counted off just after its last chunk: a liveness bound only
            while client.get(engine.url + "/load").json()["server_load"] != 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        engine.stop()


def test_bench_serving_llamacpp_options(tmp_path):
    """--llamacpp-server/--llamacpp-model without --engine llamacpp (they would be ignored), or naming no file:
    refused when the options are read."""
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    for bad, why in (({"llamacpp_model": f}, "needs --engine llamacpp"),
                     ({"engine": "standin", "standin_config": f, "llamacpp_server": f}, "needs --engine llamacpp"),
                     ({"engine": "llamacpp", "llamacpp_model": tmp_path / "none.gguf"}, "no such file")):
        with pytest.raises(pydantic.ValidationError, match=why):
            ServingBench(**bad)
    assert ServingBench(engine="llamacpp", llamacpp_model=f, llamacpp_server=f).llamacpp_model == f


def test_gguf_vocab_then_fill_keeps_metadata_and_shapes(tmp_path):
    """benchmarks.gguf_random: `vocab` keeps every key/value and the tensors' shapes but no data; `fill` writes a
    model of those shapes (matrices F16, vectors F32 ones), the same for the same seed."""
    import gguf
    import numpy as np

    from benchmarks.gguf_random import SHAPES_KEY, fill, vocab

    src = tmp_path / "src.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(1)
    w.add_token_list(["<s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("output_norm.weight", np.full(4, 2.0, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    vocab(src, tmp_path / "vocab.gguf")
    v = gguf.GGUFReader(tmp_path / "vocab.gguf")
    assert len(v.tensors) == 0 and v.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert v.fields[SHAPES_KEY].contents() == '[["token_embd.weight", [4, 3]], ["output_norm.weight", [4]]]'
    fill(tmp_path / "vocab.gguf", tmp_path / "a.gguf", seed=3)
    fill(tmp_path / "vocab.gguf", tmp_path / "b.gguf", seed=3)
    a = gguf.GGUFReader(tmp_path / "a.gguf")
    assert a.fields["llama.block_count"].contents() == 1 and SHAPES_KEY not in a.fields
    assert a.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    got = {t.name: t for t in a.tensors}
    assert got["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert [int(n) for n in got["token_embd.weight"].shape] == [4, 3]
    assert got["output_norm.weight"].data.tolist() == [1.0] * 4
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
