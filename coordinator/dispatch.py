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

    @staticmethod
    def task_for(rnd: ProbeRound, seeds: list[int], replica: int) -> ProbeTask:
        """The task evaluating `seeds` of round `rnd` as replica `replica`."""
        return ProbeTask(
            schema_version=rnd.schema_version,
            run=rnd.run,
            round_id=rnd.round_id,
            version=rnd.version,
            batch_sha256=rnd.batch_sha256,
            eps=rnd.eps,
            distribution=rnd.distribution,
            seeds=seeds,
            want_clean=rnd.want_clean,
            replica=replica,
            kind=rnd.kind,
            base_version=rnd.base_version,
            blocks=rnd.blocks,
        )

    def tasks_for(self, rnd: ProbeRound, seeds: list[int], replica: int) -> list[ProbeTask]:
        """Tasks of at most the run's `seeds_per_task` seeds covering `seeds` (in order) as `replica`."""
        k = self.run_spec(rnd.run).seeds_per_task
        return [self.task_for(rnd, seeds[i : i + k], replica) for i in range(0, len(seeds), k)]

    def publish_tasks(self, run: str, tasks: list[ProbeTask]) -> int:
        """Send `tasks` to the run's Celery queue; return how many were sent."""
        return send_probe_tasks(self.celery, self.queue_for(run), [t.model_dump(mode="json") for t in tasks])

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting in each run's Celery queue (kombu's Redis transport keeps a list per queue)."""
        if self.settings.broker_url and not hasattr(self, "_broker"):
            self._broker = redis.Redis.from_url(self.settings.broker_url, **redis_client_kwargs())
        broker = self._broker if self.settings.broker_url else self.r
        runs = sorted(self.r.smembers(self.k_runs))
        pipe = broker.pipeline()
        for run in runs:
            pipe.llen(self.queue_for(run))
        return dict(zip(runs, pipe.execute()))
