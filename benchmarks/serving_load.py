"""The open-loop request load of `sparecycles bench serving`: Poisson arrivals, prompt and output lengths from a real
text, streamed through an engine's OpenAI-compatible completions API; latency percentiles and busy-span arithmetic.

Requests come from the King James Bible as the project ships it (trainer.data.corpus, the `classics-small` source),
cut into sentences: request i's prompt is a passage of CONTEXT consecutive sentences (passages follow each other from a
seeded start), and its output length is the next sentence's length in tokens (~1.3 per word, clipped to [8, 32]); the engine is told `ignore_eos` so it generates exactly
that many. Arrivals: exponential gaps at `rate` per second from a seeded generator, sent at their times whatever the
engine's state (open loop: a slow engine builds a queue instead of slowing the load).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass

import httpx

MIN_OUT, MAX_OUT = 8, 32  # output tokens per request
CONTEXT = 4  # sentences per prompt
TOKENS_PER_WORD = 1.3


@dataclass(frozen=True)
class Request:
    """One request: when to send it (seconds after the load starts), its prompt and how many tokens to generate."""

    at_s: float
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    """One answered request (unix seconds): sent, first token, last token; tokens streamed; error if any."""

    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    prompt_words: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return None if self.first is None else self.first - self.sent

    @property
    def e2e_s(self) -> float | None:
        """Sent -> last token."""
        return None if self.end is None else self.end - self.sent


def verses(n: int) -> list[str]:
    """At least `n` + 1 sentences of the King James Bible (trainer.data.corpus's `kjv` source; downloaded once)."""
    import re

    from trainer.data.corpus import _kjv

    out: list[str] = []
    for doc in _kjv():
        for part in doc.parts:
            out += [v.strip() for v in re.split(r"(?<=[.?!])\s+", part) if len(v.split()) >= 4]
        if len(out) > n + 1:
            break
    return out


def make_requests(n: int, rate: float, seed: int, text: list[str]) -> list[Request]:
    """`n` requests at Poisson `rate` (per second); prompts (CONTEXT sentences) and output lengths (the next
    sentence's) from consecutive passages of `text` starting at a seeded offset (ValueError if it is too short)."""
    need = n * CONTEXT + 1
    if len(text) < need:
        raise ValueError(f"need {need} sentences of text, got {len(text)}")
    rng = random.Random(seed)
    start = rng.randrange(0, len(text) - need + 1)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        at = start + i * CONTEXT
        words = len(text[at + CONTEXT].split())
        out.append(Request(t, " ".join(text[at:at + CONTEXT]),
                           max(MIN_OUT, min(MAX_OUT, round(TOKENS_PER_WORD * words)))))
    return out


def _stream(client: httpx.Client, url: str, model: str, req: Request, out: Outcome) -> None:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    out.tokens += 1  # vLLM streams one token per chunk
                    if out.first is None:
                        out.first = time.time()
        out.end = time.time()
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]


def run_load(url: str, model: str, requests: list[Request], timeout_s: float = 600.0,
             stop: threading.Event | None = None) -> list[Outcome]:
    """Send `requests` open loop (one thread each, started at its time) and wait for every answer (each at most
    `timeout_s` seconds). Once `stop` is set no more are sent: the outcomes of those sent are returned."""
    outs = [Outcome(sent=0.0, prompt_words=len(r.prompt.split())) for r in requests]
    threads: list[threading.Thread] = []
    t0 = time.time()
    # A connection of its own per request, none kept alive: httpx keeps an idle connection 5 s, as long as vLLM's
    # uvicorn (timeout_keep_alive 5 s), so a request sent ~5.0 s after the last answer could go out on a connection
    # the server was closing ("Server disconnected without sending a response": one of arm (c)'s 36 requests on
    # 2026-12-06, sent 4.998 s after the one before it ended). Independent users do not share a connection either.
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0),
                      limits=httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)) as client:
        for req, out in zip(requests, outs):
            delay = max(0.0, t0 + req.at_s - time.time())
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                break
            out.sent = time.time()
            th = threading.Thread(target=_stream, args=(client, url, model, req, out), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(timeout_s)
    return outs[:len(threads)]


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p95, p99 (nearest rank) of `values` in their units; None when empty."""
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    s = sorted(values)
    return {f"p{q}": s[max(0, math.ceil(q / 100 * len(s)) - 1)] for q in (50, 95, 99)}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of closed intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Seconds where the union of `xs` meets the union of `ys`."""
    total, ys = 0.0, union(ys)
    for a, b in union(xs):
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def outcome_dict(o: Outcome) -> dict:
    """An Outcome as JSON fields, with its latencies."""
    return {**asdict(o), "ttft_s": o.ttft_s, "e2e_s": o.e2e_s}
