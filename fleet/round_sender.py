"""`RoundSender`: opens the trainer's probe rounds on the coordinator (DESIGN.md §3, "Probe round").

A round (trainer.zo.probes.RoundSpec) travels as its wire form (`RoundSpec.to_wire` → ProbeRound, the same
field names) with its batch uploaded once by content hash, encoded as the model class's batch kind
(wire.batch). The coordinator turns the round into Celery tasks (ProbeTask.split). The `scale` of
along_update results is computed here from the publisher's fp32 snapshots (the wire ProbeResult has none)
and handed to the result collector with the round's seeds.
"""

from __future__ import annotations

import hashlib

from coordinator.client import CoordinatorClient
from fleet.collector import ResultCollector
from fleet.publisher import VersionPublisher
from fleet.uploads import BlobSender, UploadQueue
from trainer.zo import probes
from trainer.zo.probes import ProbeKind, RoundSpec
from wire import batch as batch_wire
from wire.round_messages import ProbeRound


class RoundSender:
    """Sends rounds of one run; a part of fleet.backend.CoordinatorBackend.

    Args:
        publisher: the run's VersionPublisher (a round at a newer version publishes the current weights first).
        client: the coordinator's HTTP client. blobs: where batches go. uploads: the queue sends run on (the
            publisher's, so a round follows the version it probes).
        results: the collector told which seeds each round awaits.
    """

    def __init__(self, publisher: VersionPublisher, client: CoordinatorClient, blobs: BlobSender,
                 uploads: UploadQueue, results: ResultCollector) -> None:
        self.publisher, self.client, self.blobs, self.uploads, self.results = publisher, client, blobs, uploads, results
        self.batch_kind = batch_wire.batch_kind_for_model(type(publisher.model).__name__)

    def submit(self, r: RoundSpec) -> None:
        """Upload the batch (once per content) and open the round on the coordinator; returns at once.

        Like InProcessBackend, a round probes the model's current weights: a round whose version is newer
        than the last published one publishes the current weights as that version first.
        Raises ValueError for an along_update round without snapshots, a round at an older version that
        was never published, a group or slice outside the blocks (trainer.zo.probes.ProbeFitError), or a round id
        the wire format refuses.
        """
        pub = self.publisher
        self.uploads.check()
        if not pub.published or r.version > pub.published[-1]:
            pub.publish(r.version)
        elif r.version not in pub.published:
            raise ValueError(f"version {r.version} was never published (last is {pub.published[-1]})")
        if r.blocks:
            probes.check_fits(pub.blocks, r.blocks, r.slices)
        scales = self._along_update_scales(r) if ProbeKind(r.kind) is ProbeKind.ALONG_UPDATE else None
        data = batch_wire.encode_batch(r.batch, self.batch_kind)
        wire = r.to_wire(pub.run, hashlib.sha256(data).hexdigest())

        def post() -> None:
            self.blobs.upload(data)
            self.client.post_round(wire)

        self.uploads.run(post)
        self.results.expect(r.round_id, wire.seeds, scales, probes.KINDS[ProbeKind(r.kind)].forwards)

    def submit_wire(self, wire: ProbeRound, blob: bytes) -> None:
        """Open a round given in wire form (e.g. an `eval` round, fleet.evaluation) whose batch blob is `blob`: the
        blob is uploaded once per content, the round posted after it (in order with the uploads before), and its
        results are collected like any round's. Raises ValueError when the round's version was never published
        here or `blob` is not the round's batch_sha256."""
        self.uploads.check()
        if wire.version not in self.publisher.published:
            raise ValueError(f"version {wire.version} was never published here")
        if hashlib.sha256(blob).hexdigest() != wire.batch_sha256:
            raise ValueError("blob is not the round's batch (sha256 differs)")

        def post() -> None:
            self.blobs.upload(blob)
            self.client.post_round(wire)

        self.uploads.run(post)
        self.results.expect(wire.round_id, wire.seeds)

    def _along_update_scales(self, r: RoundSpec) -> dict[int, float]:
        """block -> ‖u_b‖/√n_b of the round's update (probes.update_rms), from the publisher's snapshots: computed
        at submit, since the trainer keeps publishing (and pruning snapshots) while the fleet answers."""
        snaps = self.publisher.snapshots
        missing = {r.version, r.base_version} - set(snaps)
        if missing:
            raise ValueError(f"along_update round needs snapshots of versions {sorted(missing)}; construct "
                             f"the backend with history >= 2 (have {sorted(snaps)})")
        new, base = snaps[r.version], snaps[r.base_version]
        return {int(b): probes.update_rms(new[b] - base[b]) for b in r.seeds}
