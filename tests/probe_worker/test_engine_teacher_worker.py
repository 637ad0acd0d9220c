"""Teacher rounds as a round kind of the one enrolled worker (issue 47): `sparecycles worker --teacher-engine URL`
(a real coordinator with per-worker broker users on a private Valkey, a real worker process, a real vLLM serving
SmolLM2-135M) answers the teacher rounds of the run registered at its coordinator (its queue in the heartbeats, not
on the command line; the teacher's files uploaded as blobs) with its own broker user, is listed in GET /v1/workers,
and takes no round while drained."""

from __future__ import annotations

import secrets
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from coordinator.celery_app import make_celery
from coordinator.client import CoordinatorClient
from fleet.teacher import FleetTeacher, RoundFlow, TeacherRecipe, teacher_queue
from fleet.teacher_weights import publish_teacher
from support.engine_teacher import K, real_rows
from support.fleet import AclFleet
from support.valkey import Valkey
from wire.teacher_messages import target_key


@pytest.mark.slow
def test_the_enrolled_worker_answers_teacher_rounds_through_the_engine_and_drains(
        tmp_path: Path, engine_url: str, smollm2_folder: Path) -> None:
    rows = real_rows(smollm2_folder, 2 * 2, 32)  # steps 0..1, 2 rows each

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = rows[2 * step : 2 * step + 2]
        return x, torch.roll(x, -1, 1)

    v = Valkey(tmp_path / "valkey", password=secrets.token_urlsafe(16))
    v.start()
    fleet = AclFleet(tmp_path, v.url)
    run = f"kd-{uuid.uuid4().hex[:8]}"
    queue = teacher_queue(run)
    try:
        with CoordinatorClient(fleet.url, fleet.admin_token) as admin:
            publish_teacher(admin, str(smollm2_folder), run)
        fleet.start_worker("t", "--teacher-engine", engine_url)
        wid = fleet.wait_consuming("t")
        assert fleet.worker_info("t")["state"] == "active"
        assert [w["worker_id"] for w in fleet.admin.get("/v1/workers").json()] == [wid]
        store = redis.Redis.from_url(v.url)
        recipe = TeacherRecipe(str(smollm2_folder), "topk", K, 1.0, 0, student=str(smollm2_folder))
        teacher = FleetTeacher(make_celery(v.url), store, run=run, teacher=recipe, batch_fn=batch_fn,
                               flow=RoundFlow(window=2, strict=True, strict_timeout_s=120.0), steps=2)
        teacher.seek(0)
        for step in (0, 1):
            got = teacher.take(batch_fn(step)[0], 49152)
            assert got is not None and got.ids.shape == (2, 32, K) and bool((got.logp <= 0).all())
        assert teacher.stats()["kd_taken_steps"] == 2

        # drained on request: the worker stops consuming its teacher queue, a round sent then waits in the queue
        assert fleet.admin.post(f"/v1/workers/{wid}/drain").status_code == 200
        log = tmp_path / "t.log"
        fleet.wait(lambda: f"stopped consuming {queue}" in log.read_text(), "the worker to leave its teacher queue")
        later = FleetTeacher(make_celery(v.url), store, run=run + "-b", queue=queue, teacher=recipe,
                             batch_fn=batch_fn, flow=RoundFlow(window=1, strict=True, strict_timeout_s=120.0), steps=1)
        later.seek(0)  # its one round (step 0) sent while the worker is drained
        time.sleep(2.0)  # room for a wrong take (not an assertion on timing)
        assert store.llen(queue) == 1
        assert not store.exists(target_key(later.run, 0, later.recipe, later.task_for(0).key))
        assert fleet.admin.post(f"/v1/workers/{wid}/resume").status_code == 200
        assert later.take(batch_fn(0)[0], 49152) is not None and later.stats()["kd_missing_steps"] == 0
        assert store.llen(queue) == 0
        text = log.read_text()
        assert "NOPERM" not in text and "No permissions" not in text and "loaded on" not in text
    finally:
        fleet.close()
        v.stop()
