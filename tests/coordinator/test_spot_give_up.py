"""Spot checks that run out of re-dispatches (`Intake._give_up`) with a liar in the round: real Redis, a real
uvicorn server, results posted over HTTP in chosen orders (max_redispatch=1, so the second `same_worker`
refusal of a replica gives up).

The fleet test `test_lying_worker_is_quarantined_and_never_used` lost an honest seed this way: the liar's
replica 0 and an honest replica 1 disagreed, the honest worker that posted replica 1 kept taking the seed's
replica-2 task (`same_worker` each time, re-dispatch bound spent) and the seed was dropped, although the
liar had been quarantined already (outvoted on another seed).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from coordinator.client import CoordinatorClient
from coordinator.stream import ResultStreamReader
from probe_worker.metrics import WorkerMetrics
from probe_worker.runtime import ProbeRuntime
from support.coordinator import Env, open_spot_round, result, running_env
from wire.round_messages import ProbeResult, ProbeTask

RUN, RID = "g", "r0"


@pytest.fixture
def env(tmp_path):
    yield from running_env(tmp_path, max_redispatch=1)


def _post(client, res: dict) -> list[str]:
    reply = client.post(f"/v1/runs/{RUN}/results", json={"results": [res]})
    assert reply.status_code == 200, reply.text
    return reply.json()["outcomes"]


def _runtime(env: Env, name: str) -> tuple[ProbeRuntime, CoordinatorClient]:
    """A worker's ProbeRuntime on the real coordinator whose evaluation is stubbed (loss 1.25, 1.5 per seed): the
    subject is what it posts and how it reads intake's outcomes, not the loss math."""
    reg, _ = env.enroll(name)
    client = CoordinatorClient(env.url, reg["worker_token"])
    rt = ProbeRuntime(client, reg["worker_id"], None, WorkerMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    rt.evaluate = lambda task: [  # type: ignore[method-assign]
        ProbeResult(run=task.run, round_id=task.round_id, seed=s, version=task.version, worker_id=rt.worker_id,
                    replica=task.replica, l_plus=1.25, l_minus=1.5) for s in task.seeds]
    return rt, client


def _task(seed: int, replica: int) -> ProbeTask:
    return ProbeTask(run=RUN, round_id=RID, version=0, batch_sha256="0" * 64, eps=1e-3, distribution="rademacher",
                     seeds=[seed], want_clean=False, replica=replica)


def _events(env: Env) -> list:
    reader = ResultStreamReader(env.settings.redis_url, RUN, key_prefix=env.settings.key_prefix)
    try:
        return [e for _, e in reader.read(count=100, block_ms=10)]
    finally:
        reader.r.close()


def test_give_up_keeps_the_honest_value_once_the_liar_is_quarantined(env: Env):
    """Liar L posts replica 0 of s0 and s1 first; honest H1 posts replica 1 of both (disagree: replica-2 tasks);
    honest H2 outvotes L on s0 (L quarantined); H1 then takes s1's replica 2 twice (same_worker, bound spent):
    s1's one value not from a quarantined worker (H1's) is streamed, unverified, never dropped."""
    s0, s1 = 10, 11
    open_spot_round(env, RUN, RID, [s0, s1])
    (rl, liar), (r1, h1), (r2, h2) = env.enroll("liar"), env.enroll("h1"), env.enroll("h2")
    L, H1, H2 = rl["worker_id"], r1["worker_id"], r2["worker_id"]
    for s in (s0, s1):
        assert _post(liar, result(RUN, RID, s, L, lp=9.0, lm=9.0)) == ["held"]
    for s in (s0, s1):
        assert _post(h1, result(RUN, RID, s, H1, lp=1.25 + s, lm=1.5, replica=1)) == ["held"]
    third = [(t["kwargs"]["seeds"], t["kwargs"]["replica"]) for t in env.queue_messages(RUN)]
    assert third[-2:] == [([s0], 2), ([s1], 2)]
    assert _post(h2, result(RUN, RID, s0, H2, lp=1.25 + s0, lm=1.5, replica=2)) == ["held"]
    assert env.admin.get(f"/v1/workers/{L}").json()["state"] == "quarantined"
    for _ in range(2):  # the first refusal re-dispatches (bound 1), the second gives up
        assert _post(h1, result(RUN, RID, s1, H1, lp=1.25 + s1, lm=1.5, replica=2)) == ["same_worker"]
    events = _events(env)
    assert [(e.kind, e.seed) for e in events] == [("accepted", s0), ("accepted", s1)]
    assert (events[0].verified, events[0].result.worker_id, events[0].result.l_plus) == (True, H1, 1.25 + s0)
    assert (events[1].verified, events[1].result.worker_id, events[1].result.l_plus) == (False, H1, 1.25 + s1)
    assert env.admin.get(f"/v1/runs/{RUN}/rounds/{RID}").json()["done"] == 2


def test_give_up_still_drops_a_disagreement_nobody_was_caught_in(env: Env):
    """Without a quarantined worker behind either value, values that disagree are dropped when the bound is
    spent (either may be the liar's): the round is told with one `dropped` event."""
    s0 = 20
    open_spot_round(env, RUN, RID, [s0])
    (ra, a), (rb, b) = env.enroll("a"), env.enroll("b")
    A, B = ra["worker_id"], rb["worker_id"]
    assert _post(a, result(RUN, RID, s0, A, lp=1.0)) == ["held"]
    assert _post(b, result(RUN, RID, s0, B, lp=3.0, replica=1)) == ["held"]
    for _ in range(2):
        assert _post(b, result(RUN, RID, s0, B, lp=3.0, replica=2)) == ["same_worker"]
    assert [(e.kind, e.seed) for e in _events(env)] == [("dropped", s0)]
    assert env.admin.get(f"/v1/workers/{A}").json()["state"] == "active"


def test_worker_hands_back_only_for_a_replica_intake_kept_as_its_own(env: Env):
    """A worker whose replica 0 was a `duplicate` (the liar's replica 0 came first) evaluates the seed's replica 2
    itself (intake holds it: the liar is outvoted); the worker whose replica 1 is held hands it back. Handing
    back on a duplicate left the task to the one worker intake refuses (`same_worker`), spending the bound."""
    s0 = 30
    open_spot_round(env, RUN, RID, [s0])
    rl, liar = env.enroll("liar")
    x, cx = _runtime(env, "x")
    y, cy = _runtime(env, "y")
    try:
        assert _post(liar, result(RUN, RID, s0, rl["worker_id"], lp=9.0, lm=9.0)) == ["held"]
        assert x.run_task(_task(s0, 0)).outcomes == ["duplicate"]
        assert y.run_task(_task(s0, 1)).outcomes == ["held"]  # disagrees with the liar: a replica-2 task
        assert (x.should_hand_back(_task(s0, 2)), y.should_hand_back(_task(s0, 2))) == (False, True)
        assert x.run_task(_task(s0, 2)).outcomes == ["held"]
        assert env.admin.get(f"/v1/workers/{rl['worker_id']}").json()["state"] == "quarantined"
        events = _events(env)
        assert [(e.kind, e.seed, e.verified, e.result.worker_id) for e in events] == [("accepted", s0, True, y.worker_id)]
    finally:
        cx.close()
        cy.close()
