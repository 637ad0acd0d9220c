"""`CoordinatorBackend`: the `ProbeBackend` (trainer/zo/backend.py) over the coordinator and its fleet, composed
of three parts with one job each, sharing one HTTP client and one upload queue:

- `publisher` (fleet.publisher.VersionPublisher): weight versions (shards, host buffers, manifests, ledger
  entries, fp32 snapshots);
- `rounds` (fleet.round_sender.RoundSender): probe rounds (batch upload, wire round);
- `results` (fleet.collector.ResultCollector): accepted results from the run's Redis Stream (consumer group,
  dedupe, retractions, drops, the coordinator's intake counts).

Bytes go through fleet.uploads (BlobSender: HTTP or the shared blob directory; UploadQueue: in order, on one
background thread with `background=True`, which `train --coordinator` and `up` use: the training loop then
pays only for copying the weights to reused host buffers). An upload's error is raised by the next call
(publish, publish_ledger, submit, collect, flush, close). Every HTTP call goes through
coordinator.client.CoordinatorClient (timeouts, bounded tenacity retries). A backend made `recoverable` outlives a
coordinator that lost its run (fleet.recovery: recovery is part of the backend, not a wrapper around it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.client import CoordinatorClient
from fleet.collector import ResultCollector
from fleet.publisher import VersionPublisher
from fleet.recovery import WireRound, recovering
from fleet.round_sender import RoundSender
from fleet.uploads import BlobSender, UploadQueue
from trainer.ledger import phase as ledger_phase
from trainer.zo import probes
from trainer.zo.backend import Collected
from trainer.zo.probes import RoundSpec
from wire.messages import RunSpec
from wire.round_messages import ProbeRound

log = logging.getLogger("sparecycles.fleet")


@dataclass(frozen=True)
class FleetAddress:
    """Where a fleet is, as the trainer reaches it: the coordinator's base URL (http(s)) and admin token (creates
    runs, publishes versions and rounds), the Redis/Valkey URL holding its result streams and its key prefix
    (the coordinator's SPARECYCLES_KEY_PREFIX)."""

    coordinator_url: str
    admin_token: str
    redis_url: str
    key_prefix: str = "sc"

    @classmethod
    def of(cls, base: str, settings: Any) -> FleetAddress:
        """The address of the coordinator at `base` with `settings` (fleet.attach.FleetSettings: a SecretStr admin
        token, redis_url, key_prefix)."""
        return cls(base, settings.admin_token.get_secret_value(), settings.redis_url, settings.key_prefix)


@dataclass(frozen=True)
class BackendTuning:
    """How `CoordinatorBackend.connect` sets up its parts. VersionPublisher: `shard_bytes` (bytes per weight shard),
    `history` (fp32 snapshots kept), `max_pending` (versions uploading at once), `upload_threads`; BlobSender:
    `blob_dir` (the coordinator's blob directory when this process shares its disk, else HTTP); UploadQueue:
    `background` (uploads on a background thread); ResultCollector: `consumer` (stream consumer name),
    `claim_idle_ms` (a pending entry idle this long is claimed), `round_timeout_s`; the HTTP client: `timeout_s` (per
    request), `attempts` and, once the run is reached, `outage_s` (seconds a coordinator that stopped answering is
    waited for: a restart, a rolling deploy)."""

    consumer: str = "trainer-0"
    round_timeout_s: float = 300.0
    claim_idle_ms: int = 60_000
    shard_bytes: int = 256 << 20
    timeout_s: float = 30.0
    attempts: int = 5
    outage_s: float = 120.0
    history: int = 2
    background: bool = False
    max_pending: int = 2
    blob_dir: str | Path | None = None
    upload_threads: int = 8

    @classmethod
    def publishing(cls, blob_dir: str | Path | None, *, history: int = 0, background: bool = True) -> BackendTuning:
        """A trainer's backend that publishes as it trains: uploads in the background, no snapshots kept."""
        return cls(history=history, background=background, blob_dir=blob_dir)


class CoordinatorBackend:
    """ProbeBackend whose rounds are evaluated by the coordinator's probe workers: `publisher`, `rounds` and
    `results` composed (module docstring). Build one with `connect`; the parts are public for callers that
    need one of them (timings, the blob sender, the stream)."""

    evaluates_published = True  # workers probe published versions: a resume re-publishes and re-issues

    def __init__(self, client: CoordinatorClient, uploads: UploadQueue, publisher: VersionPublisher,
                 rounds: RoundSender, results: ResultCollector) -> None:
        self.client, self.uploads, self.publisher, self.rounds, self.results = client, uploads, publisher, rounds, results
        self.spec: RunSpec | None = None  # set by `recoverable`: the run is created again when the coordinator loses it
        self.republish: Callable[[VersionPublisher], None] | None = None
        self.recreated = 0  # times the run was created again (fleet.recovery)
        self.inflight: dict[str, RoundSpec | WireRound] = {}  # rounds awaited, re-issued after a loss (recoverable)

    def recoverable(self, spec: RunSpec, republish: Callable[[VersionPublisher], None] | None = None
                    ) -> CoordinatorBackend:
        """Make this backend outlive a coordinator whose store comes back empty (fleet.recovery): a call that finds
        run `spec` lost creates it again, re-publishes (`republish(publisher)` when given: the owner's versions;
        else the publisher's snapshots or the model's current weights) and re-issues the rounds in flight, then is
        made again. Returns self."""
        self.spec, self.republish = spec, republish
        return self

    @classmethod
    def connect(cls, model: torch.nn.Module, run: RunSpec | str, address: FleetAddress,
                tuning: BackendTuning = BackendTuning()) -> CoordinatorBackend:
        """A backend for `run` (a RunSpec, created if absent, or the id of an existing run) on the fleet at `address`
        (the coordinator, its admin token, the Redis holding its state), its parts set up by `tuning`.

        Raises ValueError for a model the publisher refuses; CoordinatorHTTPError if the run does not exist.
        """
        t = tuning
        client = CoordinatorClient(address.coordinator_url, address.admin_token, timeout_s=t.timeout_s,
                                   attempts=t.attempts)
        if isinstance(run, RunSpec):
            client.create_run(run)
            run = run.run
        client.run_info(run)  # raises if the run does not exist
        client.outage_s = t.outage_s  # reached: from here on a closed port is a restart to wait out, not a wrong address
        blobs, uploads = BlobSender(client, t.blob_dir), UploadQueue(t.background)
        publisher = VersionPublisher(model, run, client, blobs, uploads, shard_bytes=t.shard_bytes, history=t.history,
                                     max_pending=t.max_pending, upload_threads=t.upload_threads)
        results = ResultCollector(client, run, redis_url=address.redis_url, key_prefix=address.key_prefix,
                                  consumer=t.consumer, claim_idle_ms=t.claim_idle_ms, round_timeout_s=t.round_timeout_s)
        return cls(client, uploads, publisher, RoundSender(publisher, client, blobs, uploads, results), results)

    # ---- what callers read ----------------------------------------------------------------------------

    @property
    def run(self) -> str:
        """The coordinator run's id."""
        return self.publisher.run

    @property
    def blocks(self) -> list[probes.Block]:
        """The model's canonical blocks."""
        return self.publisher.blocks

    @property
    def block_sizes(self) -> list[int]:
        """numel of each canonical block, in order (as InProcessBackend.block_sizes)."""
        return probes.block_sizes(self.publisher.blocks)

    @property
    def latest_version(self) -> int | None:
        """The newest version published (snapshot or ledger entry), None before the first."""
        return self.publisher.latest_version

    @property
    def published(self) -> list[int]:
        """Versions published, in order."""
        return self.publisher.published

    @property
    def snapshots(self) -> dict[int, list[torch.Tensor]]:
        """version -> fp32 copies of the canonical blocks, for the last `history` versions published."""
        return self.publisher.snapshots

    @property
    def forward_passes(self) -> int:
        """Fleet forward passes behind the results handed out (2 per seed, 1 for a group_line seed, +1 per round's
        clean loss)."""
        return self.results.forward_passes

    @forward_passes.setter
    def forward_passes(self, value: int) -> None:  # a resumed run restores its count (trainer.zo.modes)
        self.results.forward_passes = value

    # ---- ProbeBackend -----------------------------------------------------------------------------------

    # The training thread's time in these calls goes to the run's time ledger (trainer.ledger): `publish` for what
    # hands versions and rounds to the fleet, `wait` for collecting a round with a deadline.

    # Each call below runs through fleet.recovery.recovering: on a `recoverable` backend, one that finds the run
    # lost creates it again (recreate) and is made again.

    def publish(self, version: int, weights: list[torch.Tensor] | None = None) -> None:
        """VersionPublisher.publish: the model's current weights (or `weights`) as `version`. A version that a
        recovery made during this call published again itself (an owner's `republish`) is not published twice."""
        start = self.recreated

        def once() -> None:
            if self.recreated == start or version not in self.publisher.published:
                self.publisher.publish(version, weights)

        with ledger_phase("publish"):
            recovering(self, once)

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        """VersionPublisher.publish_weights: fp32 canonical blocks as `version` (a resumed run)."""
        with ledger_phase("publish"):
            recovering(self, lambda: self.publisher.publish_weights(version, blocks))

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        """VersionPublisher.publish_ledger: pure-ZO `version` as a seed-ledger entry. Returns True. When the run is
        found lost by this very call the model already holds `version`'s weights: the recovery publishes them as a
        snapshot of `version`, which replaces the entry."""
        before = self.publisher.latest_version

        def once() -> bool:
            latest = self.publisher.latest_version
            if latest is not None and latest >= version:
                return True  # re-published by the recovery itself
            return self.publisher.publish_ledger(version, seeds, coeffs, dist, scale, scale_min_dim)

        with ledger_phase("publish"):
            return recovering(self, once, current=version if before is not None and before < version else None)

    def submit(self, probe_round: RoundSpec) -> None:
        """RoundSender.submit: open the round on the coordinator; returns at once."""
        with ledger_phase("publish"):
            recovering(self, lambda: self.rounds.submit(probe_round))
        self.inflight[probe_round.round_id] = probe_round

    def submit_wire(self, wire: ProbeRound, blob: bytes) -> None:
        """RoundSender.submit_wire: open a round given in wire form (an `eval` round: fleet.evaluation)."""
        with ledger_phase("publish"):
            recovering(self, lambda: self.rounds.submit_wire(wire, blob))
        self.inflight[wire.round_id] = WireRound(wire, blob)

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0, counts: bool = False) -> Collected:
        """ResultCollector.collect, raising a failed upload's error first (and while waiting: a round whose
        upload failed never completes); the coordinator's intake counts only with `counts` (an HTTP call)."""

        def once() -> Collected:
            self.uploads.check()
            with ledger_phase("wait") if round_id is not None else contextlib.nullcontext():
                return self.results.collect(round_id, timeout_s, poll=self.uploads.check, counts=counts)

        out = recovering(self, once)
        self.inflight = {rid: r for rid, r in self.inflight.items() if self.results.awaits(rid)}
        return out

    def flush(self) -> None:
        """Wait for every background upload; raises the first one's error."""
        recovering(self, self.uploads.flush)

    def forget(self, round_id: str) -> None:
        """The owner no longer wants `round_id`'s results (e.g. it evaluated them itself): neither awaited nor
        re-issued after a loss."""
        self.inflight.pop(round_id, None)
        self.results.forget(round_id)

    def withdraw(self, round_id: str) -> None:
        """`forget` the round and close it on the coordinator (POST .../rounds/{id}/close): no worker keeps
        evaluating it (workers skip its queued tasks, nothing is re-dispatched). Best effort: a failure is logged,
        never raised (the round's results are simply not awaited any more)."""
        self.forget(round_id)
        try:
            self.client.close_round(self.run, round_id)
        except Exception as exc:  # noqa: BLE001 - withdrawing saves the fleet work; the run goes on without it
            log.warning("could not withdraw round %s of run %s: %s", round_id, self.run, exc)

    def close(self, wait: bool = True, end: bool = False) -> None:
        """Finish the background uploads (raising the first one's error), then close the HTTP client and the
        Redis connection. `wait=False` (a run that already failed or was interrupted) cancels the uploads not
        yet started instead of waiting for them. `end`: the run is over: its rounds are cancelled on the
        coordinator (POST /v1/runs/{run}/end: workers stop consuming its queue within one control interval);
        best effort, logged on failure."""
        try:
            self.uploads.close(wait)
        finally:
            if end:
                try:
                    self.client.end_run(self.run)
                except Exception as exc:  # noqa: BLE001 - the run's own outcome stands; workers idle on a stale run
                    log.warning("could not end run %s on the coordinator: %s", self.run, exc)
            self.publisher.close(wait)
            self.client.close()
            self.results.close()
