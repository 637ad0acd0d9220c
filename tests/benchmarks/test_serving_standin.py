"""The stand-in serving engine (benchmarks/serving_standin.py, what `bench serving --engine standin` runs where vLLM
cannot go): a real HTTP server over a tiny seeded Llama. It streams exactly max_tokens tokens, counts a request on
/load while it is held, and a yielding worker's EngineProbe reads both its /load and its vLLM-named gauges."""

from __future__ import annotations

import json
import threading
import time

import httpx

from api.server import free_port
from benchmarks.serving_standin import StandinProcess
from probe_worker.serving import EngineProbe, ServingPolicy
from support.standin import CONFIG


def test_standin_streams_max_tokens_and_shows_its_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    engine = StandinProcess(tmp_path, free_port(), tmp_path / "engine.log",
                            extra_args=["--config", str(tmp_path / "config.json"), "--threads", "1"])
    with engine, httpx.Client(base_url=engine.url, timeout=120) as client:
        body = {"model": "standin", "prompt": "in the beginning", "max_tokens": 5, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as reply:
            lines = [ln for ln in reply.iter_lines() if ln.startswith("data: ")]
        assert len(lines) == 6 and lines[-1] == "data: [DONE]"
        probes = [EngineProbe(ServingPolicy(metrics_url=engine.url + path)) for path in ("/load", "/metrics")]
        assert [p.read() for p in probes] == [0.0, 0.0]
        long = threading.Thread(target=client.post, args=("/v1/completions",),
                                kwargs={"json": {"prompt": "x", "max_tokens": 600}})
        long.start()
        seen = set()
        while long.is_alive():
            seen.add(probes[0].read())
        long.join()
        assert 1.0 in seen  # held while answered
        # released after: the server's handler counts it off just after its last byte, which this test may read
        # first, so wait for it (a liveness bound only)
        deadline = time.monotonic() + 60
        while probes[0].read() != 0.0:
            assert time.monotonic() < deadline, "the stand-in still counts an answered request on /load"
            time.sleep(0.05)
        for p in probes:
            p.close()


def test_bench_serving_refuses_stand_in_options_it_would_ignore_or_fail_on_late(tmp_path):
    """`bench serving`'s model: --standin-config without --engine standin (a real vLLM would start, the option
    ignored), a config that is not a file or a tokenizer that is not a folder: refused when the options are read."""
    import pydantic
    import pytest

    from benchmarks.serving_options import ServingBench

    config = tmp_path / "config.json"
    config.write_text("{}")
    for bad, why in (({"standin_config": config}, "needs --engine standin"),
                     ({"engine": "standin"}, "needs --standin-config"),
                     ({"engine": "standin", "standin_config": tmp_path / "none.json"}, "no such file"),
                     ({"engine": "standin", "standin_config": config, "standin_tokenizer": config}, "no such folder")):
        with pytest.raises(pydantic.ValidationError, match=why):
            ServingBench(**bad)
    assert ServingBench(engine="standin", standin_config=config, standin_tokenizer=tmp_path).engine == "standin"
