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


def _at(rows: list[dict], t: float) -> dict:
    """The last sample at or before `t` ({"t": 0} before the first)."""
    return max((r for r in rows if r["t"] <= t), key=lambda r: r["t"], default={"t": 0.0})


def _rate(r0: dict, r1: dict, run: str) -> float:
    """`run`'s worker-seconds per second between samples r0 and r1."""
    return (r1.get(run, 0.0) - r0.get(run, 0.0)) / max(r1["t"] - r0["t"], 1e-9)


def _last_growth(rows: list[dict], run: str) -> float:
    """The time of the last sample at which `run`'s worker-seconds had grown since the one before (0 if never)."""
    grew = [r1["t"] for r0, r1 in zip([{"t": 0.0}, *rows], rows) if r1.get(run, 0.0) > r0.get(run, 0.0)]
    return max(grew, default=0.0)


def summarize(o: SharesOptions, rows: list[dict], ended_at: float, lease_s: float) -> dict:
    """The figures of `rows` (samples {t, a, b} in worker-seconds, seconds since the start; a ended at `ended_at`):
    the ratio a/b at a's end against the shares', the same over the shared span's second half (both runs warm), each
    run's worker-seconds per second in that half, b's from one lease after a's end, and when a's counter last grew."""
    end, half = _at(rows, ended_at), _at(rows, ended_at / 2)
    w = {run: end.get(run, 0.0) for run in ("a", "b")}
    half_w = {run: w[run] - half.get(run, 0.0) for run in ("a", "b")}
    want = o.share_a / o.share_b
    tail = [r for r in rows if r["t"] >= ended_at + lease_s]
    return {
        "target_ratio": want,
        "worker_seconds_at_end": w,
        "ratio_at_end": w["a"] / w["b"] if w["b"] else None,
        "ratio_error_at_end": (w["a"] / w["b"]) / want - 1 if w["b"] else None,
        "ratio_second_half": half_w["a"] / half_w["b"] if half_w["b"] else None,
        "a_rate_shared": _rate(half, end, "a"),
        "b_rate_shared": _rate(half, end, "b"),
        "b_rate_alone": _rate(tail[0], tail[-1], "b") if len(tail) > 1 else None,
        "a_last_growth_after_end_s": max(0.0, _last_growth(rows, "a") - ended_at),
    }


def plot(rows: list[dict], ended_at: float, o: SharesOptions, path: Path) -> None:
    """Worker-seconds of each run over time (the samples), a's end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, share in (("a", o.share_a), ("b", o.share_b)):
        ax.plot([r["t"] for r in rows], [r.get(run, 0.0) for r in rows], label=f"run {run} (share {share:g})")
    ax.axvline(ended_at, color="grey", linestyle="--", label="a ends")
    ax.set_xlabel("seconds")
    ax.set_ylabel("worker-seconds (sparecycles_run_worker_seconds_total)")
    ax.set_title(f"{o.workers} CPU workers, shares {o.share_a:g}:{o.share_b:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_shares_bench(o: SharesOptions, log: Callable[[str], None]) -> dict:
    """Run the bench (module docstring); writes OUT/shares.json and OUT/shares.png and returns the report. Raises
    RuntimeError when the fleet does not come up or a pump fails."""
    import json
    import tempfile

    import httpx

    from benchmarks.churn import FAST_FLEET, ChurnOptions, start_site
    from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
    from wire.messages import RunSpec, share_fields

    folder = Path(tempfile.mkdtemp(prefix="shares-"))
    site = start_site(ChurnOptions(workers=o.workers, redis_url=o.redis_url), folder)
    try:
        log(f"{o.workers} workers up; runs a (share {o.share_a:g}) and b (share {o.share_b:g})")
        model, batch = probe_model(o.width, o.seq_len), token_batch(o.batch_size, o.seq_len, seed=1)
        address = FleetAddress(site.url, site.admin, site.redis_url, site.prefix)
        backends = {run: CoordinatorBackend.connect(model, RunSpec(
            run=run, model_class=type(model).__name__, spot_check_fraction=0.0, seeds_per_task=o.seeds_per_task,
            **share_fields(share)), address, BackendTuning(round_timeout_s=300.0))
            for run, share in (("a", o.share_a), ("b", o.share_b))}
        for be in backends.values():
            be.publish(0)
        pumps = {run: RoundPump(be, batch, o.seeds, ahead=3, name=run).start() for run, be in backends.items()}
        admin = httpx.Client(base_url=site.url, headers={"Authorization": f"Bearer {site.admin}"}, timeout=30)
        t0 = time.monotonic()
        read = lambda: worker_seconds(admin.get("/metrics").text)  # noqa: E731
        rows = sample(read, lambda: time.monotonic() - t0 >= o.duration_s, t0)
        pumps["a"].stop()
        backends["a"].close(end=True)
        ended_at = time.monotonic() - t0
        log(f"a ended at {ended_at:.1f} s; b alone for {o.tail_s:g} s")
        rows += sample(read, lambda: time.monotonic() - t0 >= ended_at + o.tail_s, t0)
        pumps["b"].stop()
        backends["b"].close(end=True)
        for run, pump in pumps.items():
            if pump.error is not None:
                raise RuntimeError(f"run {run}'s rounds failed: {pump.error!r}")
        lease_s = float(FAST_FLEET["SPARECYCLES_LEASE_SECONDS"])
        report = {"options": json.loads(o.model_dump_json()), "lease_s": lease_s, "a_ended_at_s": ended_at,
                  "rounds": {run: len(p.done) for run, p in pumps.items()}, "work": str(folder),
                  "figures": summarize(o, rows, ended_at, lease_s), "samples": rows}
    finally:
        site.stop_all()
    o.out.mkdir(parents=True, exist_ok=True)
    (o.out / "shares.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, ended_at, o, o.out / "shares.png")
    return report
