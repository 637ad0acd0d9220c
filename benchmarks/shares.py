"""`sparecycles bench shares`: two runs share a local fleet of CPU workers at stated shares; how the workers' time splits.

A coordinator process and `--workers` worker processes (benchmarks.churn.start_site: a key prefix of its own, short
leases), then two runs (`a` at `--share-a`, `b` at `--share-b`), each fed by a `RoundPump`: a thread keeping `ahead`
probe rounds of the same shape open (so its queue never runs dry), for `--duration-s` seconds; then run a ends (as a
trainer that finishes ends its coordinator runs) and b goes on alone for `--tail-s` seconds. Once a second the bench
reads the coordinator's `sparecycles_run_worker_seconds_total{run}` (the series the shares are measured in).
Figures: each run's worker-seconds and their ratio at a's end against the shares' ratio, and the seconds from a's end
until b's worker-seconds grow at the whole pool's rate (every worker on b). JSON and a plot under `--out`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from wire.bounds import MAX_SHARE


class SharesOptions(BaseModel):
    """`bench shares`'s options. Raises pydantic.ValidationError for a value outside its bound."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(4, ge=2, le=16, description="CPU probe workers in the pool")
    share_a: float = Field(3.0, gt=0, le=MAX_SHARE, allow_inf_nan=False, description="Run a's share")
    share_b: float = Field(1.0, gt=0, le=MAX_SHARE, allow_inf_nan=False, description="Run b's share")
    duration_s: float = Field(120.0, ge=10, le=86_400, description="Seconds both runs submit rounds")
    tail_s: float = Field(20.0, ge=5, le=3600, description="Seconds b runs alone after a ends")
    seeds: int = Field(16, ge=1, le=256, description="Probe seeds per round")
    seeds_per_task: int = Field(4, ge=1, le=64, description="Seeds per task")
    width: int = Field(256, ge=16, le=1024, description="Width (n_embd) of the 4-layer GPT-2 probed")
    batch_size: int = Field(8, ge=1, le=64, description="Rows of a round's batch")
    seq_len: int = Field(64, ge=2, le=512, description="Tokens per row")
    out: Path = Field(Path("results/shares"), description="Folder of shares.json and shares.png")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis of the coordinator (under a key prefix of "
                           "its own, deleted after)", json_schema_extra={"envvar": "REDIS_URL"})


def probe_model(width: int, seq_len: int):
    """A 4-layer GPT-2 (vocab 128, n_embd `width`, 4 heads) with seeded weights: the model both runs probe."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=max(64, seq_len), n_embd=width, n_layer=4, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
    return model.eval()


def token_batch(rows: int, seq_len: int, seed: int):
    """(x, y) int64 (rows, seq_len) over vocab 128, y = x shifted by one, from an explicit generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (rows, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class RoundPump:
    """Keeps `ahead` probe rounds of one run open (a thread): submits rounds of `seeds` seeds on `batch` at version 0
    (published before), collects the oldest, submits the next, until `stop()`. `done`: (round id, {worker id}) of
    each round collected, in order; `error`: what stopped it early (None)."""

    def __init__(self, backend, batch, seeds: int, ahead: int = 3, name: str = "r") -> None:
        self.backend, self.batch, self.seeds, self.ahead, self.name = backend, batch, seeds, ahead, name
        self.done: list[tuple[str, set[str]]] = []
        self.submitted_at: dict[str, float] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pump-{name}", daemon=True)

    def start(self) -> RoundPump:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Submit no more rounds; wait (at most `timeout_s`) for the round being collected."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        from trainer.zo.probes import RoundSpec

        pending: collections.deque[str] = collections.deque()
        n = 0
        try:
            while not self._stop.is_set():
                while len(pending) < self.ahead:
                    rid = f"{self.name}-{n}"
                    seeds = tuple(range(n * self.seeds, (n + 1) * self.seeds))
                    self.backend.submit(RoundSpec(rid, 0, self.batch, eps=1e-2, seeds=seeds, distribution="rademacher"))
                    self.submitted_at[rid], n = time.monotonic(), n + 1
                    pending.append(rid)
                rid = pending.popleft()
                got = self.backend.collect(rid, timeout_s=300.0).results
                self.done.append((rid, {r.worker for r in got}))
        except BaseException as exc:  # noqa: BLE001 - reported to the owner, who decides
            self.error = exc


def worker_seconds(metrics_text: str) -> dict[str, float]:
    """run -> `sparecycles_run_worker_seconds_total` from a coordinator's /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "sparecycles_run_worker_seconds_total":
                out[s.labels["run"]] = s.value
    return out


def sample(read: Callable[[], dict[str, float]], until: Callable[[], bool], t0: float,
           every_s: float = 1.0) -> list[dict]:
    """[{t (seconds since t0), run: worker-seconds, ...}] every `every_s` until `until()`."""
    rows = []
    while not until():
        rows.append({"t": time.monotonic() - t0, **read()})
        time.sleep(every_s)
    return rows
