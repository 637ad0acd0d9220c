"""Task dispatch: building probe tasks, publishing them on a run's Celery queue, queue depths (a mixin
of `coordinator.store.Store`).

Tasks are sent by name (`coordinator.celery_app.send_probe_tasks`); the broker may be another Redis than
the state store (`settings.broker_url`).
"""

from __future__ import annotations

import redis

from coordinator.celery_app import send_probe_tasks
from coordinator.keys import redis_client_kwargs
from coordinator.messages import ProbeRound, ProbeTask


class Dispatch:
    """Task building and publishing (mixed into `Store`)."""

    def queues(self) -> list[str]:
        """Celery queues of all runs (workers consume these)."""
        return sorted(self.queue_for(run) for run in self.r.smembers(self.k_runs))

    def tasks_for(self, rnd: ProbeRound, seeds: list[int], replica: int) -> list[ProbeTask]:
        """Tasks of at most the run's `seeds_per_task` seeds covering `seeds` (in order) as `replica`."""
        return ProbeTask.split(rnd, seeds, replica, self.run_spec(rnd.run).seeds_per_task)

    def publish_tasks(self, run: str, tasks: list[ProbeTask]) -> int:
        """Send `tasks` to the run's Celery queue; return how many were sent."""
        return send_probe_tasks(self.celery, self.queue_for(run), [t.model_dump(mode="json") for t in tasks])

    def broker_queue_length(self, run: str) -> int:
        """Messages waiting in `run`'s Celery queue (not yet taken by a worker)."""
        return int(self._broker_client().llen(self.queue_for(run)))

    def _broker_client(self) -> redis.Redis:
        if self.settings.broker_url and not hasattr(self, "_broker"):
            self._broker = redis.Redis.from_url(self.settings.broker_url, **redis_client_kwargs())
        return self._broker if self.settings.broker_url else self.r

    def outstanding(self, run: str, rid: str) -> dict[int, list[int]]:
        """Seeds of an open round still without a value, by the replica that is missing: replica 0 for
        plain seeds; replicas 0 and 1 of spot-checked seeds whose value is not held yet. Seeds streamed,
        dropped or given up (the round's `dec` hash) are not outstanding."""
        from coordinator.rounds import spot_check_selected

        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(self.k_round(run, rid, "seeds"))
        pipe.hkeys(self.k_round(run, rid, "acc"))
        pipe.hgetall(self.k_round(run, rid, "dec"))
        pipe.hkeys(self.k_round(run, rid, "spot"))
        seeds, acc, dec, held = pipe.execute()
        fraction = self.run_spec(run).spot_check_fraction
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

    def outstanding_seeds(self) -> dict[str, int]:
        """Seeds of open rounds not yet delivered, per run (`n_seeds - done` summed over open rounds)."""
        out = {}
        for run in sorted(self.r.smembers(self.k_runs)):
            rids = list(self.r.smembers(self.k_run(run, "rounds:open")))
            pipe = self.r.pipeline(transaction=False)
            for rid in rids:
                pipe.hmget(self.k_round(run, rid), ["n_seeds", "done"])
            out[run] = sum(int(n) - int(d) for n, d in pipe.execute() if n is not None and d is not None)
        return out

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting in each run's Celery queue (kombu's Redis transport keeps a list per queue)."""
        broker = self._broker_client()
        runs = sorted(self.r.smembers(self.k_runs))
        pipe = broker.pipeline()
        for run in runs:
            pipe.llen(self.queue_for(run))
        return dict(zip(runs, pipe.execute()))
