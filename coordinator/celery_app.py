"""The Celery app shared by the coordinator (sends probe tasks by name) and the workers (run them).

Settings follow DESIGN.md section 3, each avoiding a known way to lose or double work: JSON only (no
pickle), late acks + reject on worker lost (a killed worker's task is redelivered), prefetch 1, a
visibility timeout longer than the longest task plus its wait, cancel long-running tasks when the broker
connection is lost, a soft shutdown before a cold one (SIGQUIT; SIGTERM's warm shutdown waits for the task),
results ignored (accepted results travel on a Redis Stream instead).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

PROBE_TASK_NAME = "sparecycles.probe"


def make_celery(
    broker_url: str, *, visibility_timeout_s: int = 3600, soft_shutdown_s: float = 30.0
) -> Celery:
    """Build the Celery app for `broker_url` (redis:// or amqp://).

    `visibility_timeout_s` (seconds) must exceed the longest probe task including its queue wait;
    `soft_shutdown_s` is how long a cold shutdown (SIGQUIT, a second SIGINT) waits before it cuts the running
    task (Celery >= 5.5; a warm shutdown, SIGTERM, waits for the task however long).
    Raises ValueError on a non-positive timeout.
    """
    if visibility_timeout_s <= 0 or soft_shutdown_s < 0:
        raise ValueError("visibility_timeout_s must be > 0 and soft_shutdown_s >= 0")
    app = Celery("sparecycles", broker=broker_url)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_soft_shutdown_timeout=soft_shutdown_s,
        worker_enable_soft_shutdown_on_idle=True,
        broker_connection_retry_on_startup=True,
        # kombu restores unacked messages of dead workers only in a periodic sweep (default every 100 s):
        # sweep at a fifth of the visibility timeout so a SIGKILLed worker's task returns promptly.
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "unacked_restore_interval": max(1, visibility_timeout_s // 5),
            "unacked_restore_throttle": 1,
        },
        task_default_queue="sparecycles.default",
        worker_hijack_root_logger=False,
    )
    return app


def send_probe_tasks(app: Celery, queue: str, tasks: list[dict[str, Any]]) -> int:
    """Publish probe tasks (each a `ProbeTask.model_dump(mode="json")`) to `queue`; return the count.

    Sent by name, so the coordinator never imports the worker's task code. One producer connection is
    reused for the whole list.
    """
    with app.producer_or_acquire() as producer:
        for kwargs in tasks:
            app.send_task(PROBE_TASK_NAME, kwargs=kwargs, queue=queue, producer=producer, ignore_result=True)
    return len(tasks)
