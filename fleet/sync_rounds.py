"""`SyncRounds`: when a fleet's ZO-Curv rounds fold into the steps, independent of the fleet's timing
(`train --fleet-sync`, `sparecycles up`); a ProbeBackend wrapping fleet.backend.CoordinatorBackend."""

from __future__ import annotations

import torch


class SyncRounds:
    """A ProbeBackend wrapper that fixes at which refresh each curvature round folds, whatever the fleet's timing.

    lag 0 (`sync`, `train --fleet-sync`): `collect()` waits (up to `timeout_s` seconds per round) for every round
    submitted since the last collect, then hands out everything: each round folds at its own refresh, as in
    process, so the losses equal the in-process run's bit for bit (the workers' forward passes being
    bit-identical); the trainer waits for the fleet once per curvature interval.

    lag 1 (`next`, `sparecycles up`): a round folds at the refresh after it. `collect()` hands out the rounds
    submitted before the newest one and keeps the newest one's results back; before a newer version is published
    every round in flight is waited for, so no result can arrive stale at the coordinator (its bound S counts
    versions). The trainer waits only when the fleet is more than an interval behind; when it keeps up this is
    what an asynchronous run does, made independent of timing.

    Either way a run is reproducible, and an interrupted run resumed (trainer.zo.modes.ZOCurvMode re-issues the
    round in flight) equals the uninterrupted one. The rest of the ProbeBackend (block_sizes, latest_version,
    snapshots, forward_passes, publish_weights, publish_ledger, flush, close) is the wrapped backend's.
    Raises ValueError for a lag other than 0 or 1.
    """

    def __init__(self, backend, timeout_s: float = 300.0, lag: int = 0) -> None:
        if lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {lag}")
        self.backend, self.timeout_s, self.lag = backend, timeout_s, lag
        self._pending: list[str] = []  # rounds submitted, not yet collected
        self._held: list = []  # Collected parts waited for, not yet handed out

    @property
    def block_sizes(self) -> list[int]:
        """The wrapped backend's block sizes."""
        return self.backend.block_sizes

    @property
    def latest_version(self) -> int | None:
        """The wrapped backend's newest published version."""
        return self.backend.latest_version

    @property
    def snapshots(self) -> dict[int, list[torch.Tensor]]:
        """The wrapped backend's fp32 snapshots of its newest versions."""
        return self.backend.snapshots

    @property
    def forward_passes(self) -> int:
        """The wrapped backend's forward passes behind the results handed out."""
        return self.backend.forward_passes

    @forward_passes.setter
    def forward_passes(self, value: int) -> None:  # a resumed run restores its count (trainer.zo.modes)
        self.backend.forward_passes = value

    def publish_weights(self, version: int, blocks: list[torch.Tensor]) -> None:
        """The wrapped backend's publish_weights (a resumed run re-publishes its rounds' versions)."""
        self.backend.publish_weights(version, blocks)

    def publish_ledger(self, version: int, seeds: list[int], coeffs: list[float], dist: str,
                       scale: float = 1.0, scale_min_dim: int = 0) -> bool:
        """The wrapped backend's publish_ledger."""
        return self.backend.publish_ledger(version, seeds, coeffs, dist, scale, scale_min_dim)

    def flush(self) -> None:
        """Wait for the wrapped backend's uploads."""
        self.backend.flush()

    def close(self, wait: bool = True) -> None:
        """Close the wrapped backend."""
        self.backend.close(wait=wait)

    def _wait(self, rounds: list[str]) -> None:
        """Collect each of `rounds` (waiting up to timeout_s) into the held results."""
        for rid in rounds:
            self._held.append(self.backend.collect(rid, self.timeout_s))
            self._pending.remove(rid)

    def publish(self, version: int) -> None:
        """lag 1: wait for the rounds in flight first; then publish on the wrapped backend."""
        if self.lag:
            self._wait(list(self._pending))
        self.backend.publish(version)

    def submit(self, probe_round) -> None:
        """Submit to the wrapped backend and remember the round (lag 1: a round at a newer version, which
        publishes it, first waits for the rounds in flight)."""
        latest = self.backend.latest_version
        if self.lag and (latest is None or probe_round.version > latest):
            self._wait(list(self._pending))
        self.backend.submit(probe_round)
        self._pending.append(probe_round.round_id)

    def collect(self, round_id: str | None = None, timeout_s: float = 0.0):
        """With a round id: the wrapped backend's collect of that round (no longer waited for here). Without: wait
        for the rounds due (lag 0: all pending; lag 1: all but the newest), then hand out their results
        (trainer.zo.backend.Collected, counts summed over the calls; lag 0 also hands out any other result)."""
        from trainer.zo.backend import Collected

        if round_id is not None:
            if round_id in self._pending:
                self._pending.remove(round_id)
            return self.backend.collect(round_id, timeout_s)
        self._wait(self._pending[:-1] if self.lag else list(self._pending))
        parts, self._held = self._held, []
        if not self.lag:
            parts.append(self.backend.collect())
        counts: dict[str, int] = {}
        for c in parts:
            for k, v in c.counts.items():
                counts[k] = counts.get(k, 0) + v
        return Collected([r for c in parts for r in c.results], counts)
