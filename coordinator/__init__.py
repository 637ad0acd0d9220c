"""The sparecycles control plane (DESIGN.md section 3); imports no torch.

Modules: `messages` (strict, versioned wire models), `settings` (CoordinatorSettings from SPARECYCLES_*),
`store` (Redis state, composed of `keys`, `registry` (workers, leases, hashed tokens), `runs`
(runs, versions, ledger), `rounds`, `dispatch` (task publishing)),
`blobs` (content-addressed shard store), `celery_app` (the shared Celery app and task publishing),
`intake` (result acceptance, dedupe, staleness, spot checks, quarantine), `stream` (the trainer's
consumer-group reader of accepted results), `metrics` (Prometheus definitions), `bench` (intake bench).
"""
