"""Task dispatch: building probe tasks, publishing them on a run's Celery queue, queue depths (a part of
`coordinator.store.Store`, built with the state Redis client, the key layout, the runs and the Celery app).

Tasks are sent by name (`coordinator.celery_app.send_probe_tasks`); the broker may be another Redis than
the state store (`settings.broker_url`).
"""

from __future__ import annotations

import hashlib
import json

import redis
from celery import Celery

from coordinator.celery_app import send_probe_tasks
from coordinator.keys import Keys, redis_client_kwargs
from coordinator.runs import RunStore
from wire.round_messages import ProbeRound, ProbeTask


def spot_check_selected(run: str, round_id: str, seed: int, fraction: float) -> bool:
    """Deterministic spot-check choice: sha256("run/round/seed")[:8] / 2**64 < fraction.

    A pure function of its arguments (counter-based hashing, no RNG state), so intake can recompute it.
    """
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{run}/{round_id}/{seed}".encode()).digest()[:8], "big")
    return h < fraction * 2.0**64


class Dispatch:
    """Task building and publishing; `broker_url` None means the broker is the state Redis `r`."""

    def __init__(self, r: redis.Redis, keys: Keys, runs: RunStore, celery: Celery, broker_url: str | None) -> None:
        self.r, self.keys, self.runs, self.celery, self.broker_url = r, keys, runs, celery, broker_url
        self._broker: redis.Redis | None = None

    def tasks_for(self, rnd: ProbeRound, seeds: list[int], replica: int) -> list[ProbeTask]:
        """Tasks of at most the run's `seeds_per_task` seeds covering `seeds` (in order) as `replica`."""
        return ProbeTask.split(rnd, seeds, replica, self.runs.run_spec(rnd.run).seeds_per_task)

    def publish_tasks(self, run: str, tasks: list[ProbeTask]) -> int:
        """Send `tasks` to the run's Celery queue; return how many were sent."""
        return send_probe_tasks(self.celery, self.keys.queue_for(run), [t.model_dump(mode="json") for t in tasks])

    def broker_queue_length(self, run: str) -> int:
        """Messages waiting in `run`'s Celery queue (not yet taken by a worker)."""
        return int(self._broker_client().llen(self.keys.queue_for(run)))

    def purge_queue(self, run: str) -> int:
        """Delete the tasks waiting in `run`'s Celery queue (an ended run: no worker takes them); returns how many."""
        broker, queue = self._broker_client(), self.keys.queue_for(run)
        n = int(broker.llen(queue))
        broker.delete(queue)
        return n

    def _broker_client(self) -> redis.Redis:
        if self.broker_url and self._broker is None:
            self._broker = redis.Redis.from_url(self.broker_url, **redis_client_kwargs())
        return self._broker if self.broker_url else self.r

    def outstanding(self, run: str, rid: str) -> dict[int, list[int]]:
        """Seeds of an open round still without a value, by the replica that is missing: replica 0 for
        plain seeds; replicas 0 and 1 of spot-checked seeds whose value is not held yet. Seeds streamed,
        dropped or given up (the round's `dec` hash) are not outstanding."""
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(self.keys.k_round(run, rid, "seeds"))
        pipe.hkeys(self.keys.k_round(run, rid, "acc"))
        pipe.hgetall(self.keys.k_round(run, rid, "dec"))
        pipe.hkeys(self.keys.k_round(run, rid, "spot"))
        pipe.hget(self.keys.k_round(run, rid), "n_spot")
        seeds, acc, dec, held, n_spot = pipe.execute()
        fraction = self.runs.run_spec(run).spot_check_fraction if int(n_spot or 0) else 0.0
        resolved = set(acc) | {k for k, v in dec.items() if ":" not in k and v != "agree"}
        held = set(held)
        out: dict[int, list[int]] = {0: [], 1: []}
        for seed in sorted(int(x) for x in seeds if x not in resolved):
            if not spot_check_selected(run, rid, seed, fraction):
                out[0].append(seed)
                continue
            for replica in (0, 1):
                if f"{seed}:{replica}" not in held:
                    out[replica].append(seed)
        return out

    def spot_holders(self, run: str, rid: str, seed: int) -> set[str]:
        """Ids of the workers whose replica of spot-checked `seed` intake holds (a copy must go to another)."""
        held = self.r.hmget(self.keys.k_round(run, rid, "spot"), [f"{seed}:{r}" for r in range(3)])
        return {json.loads(v)["worker_id"] for v in held if v is not None}

    def outstanding_seeds(self) -> dict[str, int]:
        """Seeds of open rounds not yet delivered, per run (`n_seeds - done` summed over open rounds)."""
        out = {}
        for run in sorted(self.r.smembers(self.keys.k_runs)):
            rids = list(self.r.smembers(self.keys.k_run(run, "rounds:open")))
            pipe = self.r.pipeline(transaction=False)
            for rid in rids:
                pipe.hmget(self.keys.k_round(run, rid), ["n_seeds", "done"])
            out[run] = sum(int(n) - int(d) for n, d in pipe.execute() if n is not None and d is not None)
        return out

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting in each run's Celery queue (kombu's Redis transport keeps a list per queue)."""
        broker = self._broker_client()
        runs = sorted(self.r.smembers(self.keys.k_runs))
        pipe = broker.pipeline()
        for run in runs:
            pipe.llen(self.keys.queue_for(run))
        return dict(zip(runs, pipe.execute()))
