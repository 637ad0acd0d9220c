"""The sparecycles control plane (DESIGN.md section 3); imports no torch.

Modules: `messages` (strict, versioned wire models), `settings` (CoordinatorSettings from SPARECYCLES_*),
`store` (Redis state, composed of `keys`, `registry` (workers, leases, hashed tokens; its transitions are
the Lua scripts of `worker_scripts`), `runs` (runs, versions, ledger), `rounds`, `dispatch` (task
publishing, outstanding seeds)), `blobs` (content-addressed shard store), `celery_app` (the shared Celery
app and task publishing), `intake` (result acceptance, dedupe, staleness, spot checks, quarantine),
`deadlines` (re-issuing the seeds of stalled rounds), `broker_acl` (a Redis ACL user per worker),
`stream` (the trainer's consumer-group reader of accepted results), `client` (the HTTP client of the
API), `metrics` (Prometheus definitions), `errors`.
"""
