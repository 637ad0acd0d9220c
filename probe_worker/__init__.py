"""Elastic probe workers (DESIGN.md section 3): a Celery worker per device that registers with the
coordinator, caches weight versions (sha256-verified safetensors shards, or seed-ledger replay), evaluates
probe tasks without disturbing clean weights, posts the scalars, and yields to serving on drain.

Modules: client (REST), cache (weights), model_build (a version's model from its tensors), runtime (evaluation),
probes (non-seeded probe kinds), tasks (the Celery task, drain state, GPU-busy policy), worker (process lifecycle),
options (WorkerOptions, every option of `sparecycles worker`), metrics, bench, cli.
"""
