"""The trainer's side of the fleet transport: the coordinator-backed ProbeBackend and the torch wire formats.

- fleet.backend: `CoordinatorBackend` (trainer.zo.backend.ProbeBackend over the coordinator's REST API,
  coordinator.client, and its result stream, coordinator.stream), composed of
  fleet.publisher (`VersionPublisher`: weight shards, host buffers, manifests, ledger entries),
  fleet.round_sender (`RoundSender`: probe rounds and their batches) and
  fleet.collector (`ResultCollector`: the result stream's consumer group, dedupe, retractions, drops);
  fleet.uploads holds what they send bytes with (`BlobSender`, `UploadQueue`);
- wire.batch: the versioned safetensors batch format shared with probe_worker;
- fleet.attach: a training run attached to a coordinator (`train --coordinator`, `up`).

Layer: above trainer (models, data, ZO math) and coordinator (messages, client); below probe_worker,
which decodes batches with wire.batch, and the CLI (sparecycles), which builds the backend.
"""
