"""GET /v1/runs/{run}?newer_than=&wait_s=: a long poll that answers when a newer version is registered."""

from __future__ import annotations

import threading

import httpx
import pytest

from coordinator.client import CoordinatorClient, CoordinatorHTTPError
from support.worker_env import tiny_model, worker_env


@pytest.fixture
def env(tmp_path):
    yield from worker_env(tmp_path)


def test_long_poll_answers_at_once_when_newer_and_waits_for_a_registration(env):  # noqa: F811
    be = env.backend(tiny_model(), "poll")
    reader, _ = env.worker("w0")
    assert reader.run_info("poll", newer_than=-1, wait_s=0.2).latest_version == -1  # nothing newer: waited, as is
    be.publish(0)
    assert reader.run_info("poll", newer_than=-1, wait_s=10.0).latest_version == 0  # newer already: at once
    # A poll with a 10 s wait through a client whose timeout is 5 s returns only because the registration
    # during the wait woke it (otherwise the read times out and the test fails).
    short = CoordinatorClient(env.server.url, reader.token, timeout_s=5.0, attempts=1)
    timer = threading.Timer(0.3, lambda: be.publish(1))
    timer.start()
    try:
        assert short.run_info("poll", newer_than=0, wait_s=10.0).latest_version == 1
    finally:
        timer.join()
        short.close()
    be.close()


@pytest.mark.parametrize("params", [{"newer_than": 0, "wait_s": 10.5}, {"newer_than": -2, "wait_s": 1},
                                    {"newer_than": 0, "wait_s": -1}, {"newer_than": "x", "wait_s": 1}])
def test_long_poll_bounds_are_enforced(env, params):  # noqa: F811
    env.backend(tiny_model(), "bounds")
    reader, _ = env.worker("w0")
    r = httpx.get(f"{env.server.url}/v1/runs/bounds", params=params,
                  headers={"Authorization": f"Bearer {reader.token}"}, timeout=5)
    assert r.status_code == 422


def test_long_poll_on_an_unknown_run_is_404(env):  # noqa: F811
    reader, _ = env.worker("w0")
    with pytest.raises(CoordinatorHTTPError) as e:
        reader.run_info("nope", newer_than=0, wait_s=1.0)
    assert e.value.status == 404
