"""The wire protocol shared by trainer, coordinator and probe workers (one place for what crosses a process).

Torch-free (imported by the coordinator): `bounds` (every numeric bound, one annotated type each), `staleness`
(the one staleness rule), `messages` (strict, versioned pydantic messages: workers, tasks, results, runs),
`round_messages` (probe and eval rounds). Needs torch (imported by trainer, fleet and workers only): `batch`
(a round's batch as a versioned safetensors blob) and `shards` (weight shards, streamed without copies).
Nothing here imports another sparecycles package (it is the bottom layer of `lint-imports`).
"""
