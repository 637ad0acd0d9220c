"""The trainer's side of the fleet transport: the coordinator-backed ProbeBackend and the torch wire formats.

- fleet.backend: `CoordinatorBackend` (trainer.zo.backend.ProbeBackend over the coordinator's REST API,
  coordinator.client, and its result stream, coordinator.stream), weight shards and manifests;
- fleet.batch_wire: the versioned safetensors batch format shared with probe_worker.

Layer: above trainer (models, data, ZO math) and coordinator (messages, client); below probe_worker,
which decodes batches with fleet.batch_wire, and the CLI (sparecycles), which builds the backend.
"""
