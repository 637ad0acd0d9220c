"""A stand-in serving engine where vLLM cannot go (the GPU device machine: no package registry there, and vLLM's
wheels are larger than one call carries): `python -m benchmarks.serving_standin --port P --config C --device D`.

What it is, exactly: an HTTP server (the standard library's, one thread per connection) with vLLM's endpoints that
`bench serving` and engine-aware yielding use, over a transformers causal LM (`--config`: a config.json, the weights
seeded random, as throughput does not depend on them; or `--model DIR`, a saved model):

- `POST /v1/completions` (`prompt`, `max_tokens`, `stream`; always greedy and `ignore_eos`: exactly max_tokens
  tokens), one request at a time in arrival order (FIFO; no batching, unlike vLLM), a prefill then a KV-cached decode
  of one token per step; streamed as vLLM does, one server-sent event per token.
- `GET /metrics`: `vllm:num_requests_running` (0 or 1) and `vllm:num_requests_waiting` (queued) under vLLM's names,
  set when the engine takes a request and when it ends it (vLLM sets them after each engine step);
- `GET /load`: `{"server_load": N}`, requests the server holds, counted at arrival (vLLM's
  `--enable-server-load-tracking`); `GET /health`, `GET /v1/models`.

The prompt's token ids: `--tokenizer DIR`'s (or `--model`'s) tokenizer; without one, one id per whitespace-separated
word (a hash, modulo the vocabulary), ~1.3x fewer than a real tokenizer gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from probe_worker.engine import VllmProcess

MODEL_ID = "standin"


class Engine:
    """The model and its FIFO: `submit(prompt, max_tokens)` returns a queue that yields each new token id, then None.
    One engine thread runs the requests in arrival order."""

    def __init__(self, model, tokenize, device: str, vocab: int) -> None:
        self.model, self.tokenize, self.device, self.vocab = model, tokenize, device, vocab
        self.jobs: queue.Queue = queue.Queue()
        self.running = 0
        self.held = 0  # requests the HTTP side holds (arrived, not yet answered to the end)
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True, name="standin-engine").start()

    def submit(self, prompt: str, max_tokens: int) -> queue.Queue:
        out: queue.Queue = queue.Queue()
        self.jobs.put((prompt, max_tokens, out))
        return out

    def _loop(self) -> None:
        import torch

        while True:
            prompt, max_tokens, out = self.jobs.get()
            self.running = 1
            try:
                with torch.inference_mode():
                    ids = torch.tensor([self.tokenize(prompt)], device=self.device)
                    step = self.model(input_ids=ids, use_cache=True)
                    for _ in range(max_tokens):
                        nxt = step.logits[:, -1].argmax(-1, keepdim=True)
                        out.put(int(nxt.item()))
                        step = self.model(input_ids=nxt, past_key_values=step.past_key_values, use_cache=True)
            finally:
                self.running = 0
                out.put(None)

    def metrics_text(self) -> str:
        """Prometheus text: vLLM's two queue gauges."""
        lines = []
        for name, value in (("vllm:num_requests_running", self.running), ("vllm:num_requests_waiting",
                                                                           self.jobs.qsize())):
            lines += [f"# HELP {name} stand-in engine (benchmarks.serving_standin)", f"# TYPE {name} gauge",
                      f'{name}{{engine="0",model_name="{MODEL_ID}"}} {float(value)}']
        return "\n".join(lines) + "\n"


def _handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, code: int, body: str, ctype: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, "", "text/plain")
            elif self.path == "/metrics":
                self._send(200, engine.metrics_text(), "text/plain; version=0.0.4")
            elif self.path == "/load":
                self._send(200, json.dumps({"server_load": engine.held}), "application/json")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": MODEL_ID, "object": "model"}]}), "application/json")
            else:
                self._send(404, "not found", "text/plain")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, "not found", "text/plain")
                return
            with engine.lock:
                engine.held += 1
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._complete(body)
            finally:
                with engine.lock:
                    engine.held -= 1

        def _complete(self, body: dict) -> None:
            tokens = engine.submit(str(body.get("prompt", "")), int(body.get("max_tokens", 16)))
            if not body.get("stream"):
                got = list(iter(tokens.get, None))
                text = "".join(f" t{t}" for t in got)
                self._send(200, json.dumps({"choices": [{"text": text, "index": 0}],
                                            "usage": {"completion_tokens": len(got)}}), "application/json")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            for t in iter(tokens.get, None):
                chunk = {"choices": [{"text": f" t{t}", "index": 0}], "model": MODEL_ID}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


def _word_ids(vocab: int):
    def tokenize(prompt: str) -> list[int]:
        words = prompt.split() or ["."]
        return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % vocab for w in words]

    return tokenize


def load_engine(config: str | None, model_dir: str | None, device: str, dtype: str, tokenizer: str | None = None,
                seed: int = 0) -> Engine:
    """The Engine of a config.json (seeded random weights) or a saved model folder; prompts tokenized by the folder
    `tokenizer` (or the model's), else one id per word (module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=getattr(torch, dtype))
    tokenize = _word_ids(model.config.vocab_size)
    if tokenizer or model_dir:
        tok = AutoTokenizer.from_pretrained(tokenizer or model_dir)
        tokenize = lambda p: tok(p)["input_ids"] or [0]  # noqa: E731
    model = model.to(device).eval()
    return Engine(model, tokenize, device, model.config.vocab_size)


class StandinProcess(VllmProcess):
    """This module's server as a child process, with VllmProcess's interface (start, wait_ready, stop, url,
    metrics_url); `extra_args` go to its command line (--config/--model, --device, --dtype, --threads)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "benchmarks.serving_standin", "--port", str(self.port), *self.extra_args]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", help="a config.json (seeded random weights)")
    p.add_argument("--model", help="a saved model folder (weights and tokenizer)")
    p.add_argument("--tokenizer", help="a tokenizer folder for --config (default: one id per word)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    a = p.parse_args()
    if not (a.config or a.model):
        p.error("give --config or --model")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    engine = load_engine(a.config, a.model, a.device, a.dtype, a.tokenizer)
    list(iter(engine.submit("warm up the engine", 2).get, None))  # first-call costs out of the measurements
    server = ThreadingHTTPServer(("127.0.0.1", a.port), _handler(engine))
    server.daemon_threads = True
    print(f"stand-in engine on http://127.0.0.1:{a.port} ({a.device}, {a.dtype})", flush=True)
    t0 = time.monotonic()
    try:
        server.serve_forever()
    finally:
        print(f"served for {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
