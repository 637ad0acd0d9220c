"""The order in which a worker takes its queues (probe_worker.broker.TeacherFirstCycle): with teacher rounds and probe
rounds both waiting, every teacher round first, then the probe rounds; kombu's default alternates them. Real Redis,
kombu's Redis transport with the worker's transport options, one message taken and acknowledged at a time as a solo
worker with prefetch 1 takes them."""

from __future__ import annotations

import secrets

import pytest
import redis
from kombu import Connection, Consumer, Producer, Queue
from kombu.utils.scheduling import round_robin_cycle

from probe_worker.broker import TEACHER_FIRST, TeacherFirstCycle
from wire.teacher_messages import teacher_queue


def _taken(redis_url: str, strategy: str) -> list[str]:
    """Three messages on a probe queue, then three on a teacher queue; the queues the consumer took them from."""
    run = "qo" + secrets.token_hex(4)
    probe, teacher = Queue(f"qo.probe.{run}", routing_key=f"qo.probe.{run}"), Queue(teacher_queue(run),
                                                                                   routing_key=teacher_queue(run))
    taken: list[str] = []
    with Connection(redis_url, transport_options={"queue_order_strategy": strategy}) as conn:
        producer = Producer(conn.default_channel)
        for queue in (probe, teacher):
            queue(conn.default_channel).declare()
            for i in range(3):
                producer.publish({"i": i}, routing_key=queue.routing_key)

        def on_message(body, message) -> None:
            taken.append(message.delivery_info["routing_key"].split(".")[1])
            message.ack()

        channel = conn.channel()
        channel.basic_qos(0, 1, False)
        with Consumer(channel, queues=[probe, teacher], callbacks=[on_message]):
            for _ in range(6):
                conn.drain_events(timeout=10)
    r = redis.Redis.from_url(redis_url)
    r.delete(probe.name, teacher.name)
    return taken


def test_teacher_rounds_are_taken_before_probe_rounds(redis_url):
    assert _taken(redis_url, TEACHER_FIRST) == ["teacher"] * 3 + ["probe"] * 3
    default = _taken(redis_url, "round_robin")
    assert default != ["teacher"] * 3 + ["probe"] * 3 and sorted(default) == ["probe"] * 3 + ["teacher"] * 3


def test_the_cycle_keeps_round_robin_within_each_kind():
    cycle = TeacherFirstCycle()
    cycle.update(["p.a", teacher_queue("x"), "p.b", teacher_queue("y")])
    assert cycle.consume(4) == [teacher_queue("x"), teacher_queue("y"), "p.a", "p.b"]
    cycle.rotate(teacher_queue("x"))
    cycle.rotate("p.a")
    assert cycle.consume(4) == [teacher_queue("y"), teacher_queue("x"), "p.b", "p.a"]
    plain = round_robin_cycle(["p.a", teacher_queue("x")])
    assert plain.consume(2) == ["p.a", teacher_queue("x")]  # kombu's own: whatever order the queues came in


@pytest.mark.parametrize("n", [0, 1])
def test_consume_takes_at_most_n(n):
    cycle = TeacherFirstCycle(["p.a", teacher_queue("x")])
    assert len(cycle.consume(n)) == n


def test_a_worker_app_takes_teacher_rounds_first(redis_url):
    """The worker's Celery app (probe_worker.assembly.broker_app) opens channels with the teacher-first cycle."""
    from probe_worker.assembly import broker_app
    from wire.messages import WorkerRegistered

    reg = WorkerRegistered.model_construct(broker_url=redis_url, visibility_timeout_s=30.0)
    app = broker_app(reg, soft_shutdown_s=0.0)
    with app.connection_for_read() as conn:
        assert isinstance(conn.default_channel._queue_cycle, TeacherFirstCycle)
