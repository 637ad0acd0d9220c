"""The time ledger (trainer.ledger): exclusive nesting, phases summing to the wall time, JSON shape, threads; and
a real run's summary.json carrying it."""

from __future__ import annotations

import json
import threading

import pytest

from trainer.ledger import PHASES, TimeLedger, current, format_ledger, phase


class FakeClock:
    """A clock the test advances by hand: every figure below is exact."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float) -> None:
        self.t += s


def test_nested_phases_are_exclusive_and_other_takes_the_rest():
    clock = FakeClock()
    led = TimeLedger(clock=clock).start()
    clock.tick(1.0)  # unbooked: other
    with led.phase("step"):
        clock.tick(2.0)
        with led.phase("publish"):
            clock.tick(0.5)
            with led.phase("wait"):
                clock.tick(0.25)
        clock.tick(1.0)
    with led.phase("eval"):
        clock.tick(3.0)
    led.stop()
    out = led.to_json()
    assert out["wall_s"] == 7.75
    assert out["phases_s"]["step"] == 3.0 and out["phases_s"]["publish"] == 0.5
    assert out["phases_s"]["wait"] == 0.25 and out["phases_s"]["eval"] == 3.0
    assert out["phases_s"]["other"] == 1.0
    assert sum(out["phases_s"].values()) == pytest.approx(out["wall_s"], abs=1e-9)
    assert set(out["phases_s"]) == {*PHASES, "other"} and set(out["counts"]) == set(PHASES)
    assert out["counts"]["step"] == 1 and out["counts"]["checkpoint"] == 0
    assert out["share"]["eval"] == round(3.0 / 7.75, 4)
    json.dumps(out)  # plain JSON


def test_the_same_phase_nested_is_booked_once_and_stop_closes_open_phases():
    clock = FakeClock()
    led = TimeLedger(clock=clock).start()
    with led.phase("publish"):
        clock.tick(1.0)
        with led.phase("publish"):
            clock.tick(2.0)
    cm = led.phase("checkpoint")
    cm.__enter__()
    clock.tick(4.0)
    led.stop()  # an interrupted run: the open phase ends here
    cm.__exit__(None, None, None)
    out = led.to_json()
    assert out["phases_s"]["publish"] == 3.0 and out["phases_s"]["checkpoint"] == 4.0
    assert out["phases_s"]["other"] == 0.0 and out["wall_s"] == 7.0
    clock.tick(5.0)
    assert led.wall() == 7.0  # stopped


def test_module_phase_books_to_the_active_ledger_of_this_thread_only():
    clock = FakeClock()
    led = TimeLedger(clock=clock).start()
    with phase("step"):  # no ledger active: nothing booked
        clock.tick(1.0)
    with led.activate():
        assert current() is led
        with phase("wait"):
            clock.tick(2.0)

        def background():  # an upload thread: neither the context nor the ledger reach it
            assert current() is None
            with led.phase("publish"):
                clock.tick(8.0)

        t = threading.Thread(target=background)
        t.start()
        t.join()
    assert current() is None
    led.stop()
    out = led.to_json()
    assert out["phases_s"]["wait"] == 2.0 and out["phases_s"]["publish"] == 0.0
    assert out["phases_s"]["other"] == 9.0  # the 1 s before activation and the thread's 8 s: wall, not phases


def test_sync_runs_at_every_boundary_and_unknown_phases_are_refused():
    calls = []
    led = TimeLedger(clock=FakeClock(), sync=lambda: calls.append(1)).start()
    with led.phase("step"):
        pass
    led.stop()
    assert len(calls) == 4  # start, enter, exit, stop
    with pytest.raises(ValueError, match="unknown phase"):
        with led.phase("lunch"):
            pass
    lines = format_ledger(led.to_json())
    assert lines[0].startswith("time ledger: wall") and len(lines) == 1 + len(PHASES) + 1


def test_a_run_writes_its_ledger_to_the_summary(tmp_path):
    from trainer.config import TrainConfig
    from trainer.train import train

    cfg = TrainConfig(model="gpt2-tiny", steps=4, batch_size=2, seq_len=16, warmup_steps=1, eval_every=2,
                      eval_batches=1, checkpoint_every=2, run_dir=tmp_path / "run")
    res = train(cfg, progress=False, export=False)
    led = json.loads((res.run_dir / "summary.json").read_text())["time_ledger"]
    phases = led["phases_s"]
    assert sum(phases.values()) == pytest.approx(led["wall_s"], abs=1e-4)
    assert led["counts"]["step"] == 4 and led["counts"]["checkpoint"] == 2
    assert led["counts"]["eval"] >= 3  # steps 0, 2, 4 (+ the task's final metrics)
    assert all(phases[k] > 0 for k in ("startup", "step", "eval", "checkpoint", "log"))
    assert phases["publish"] == 0.0 and phases["wait"] == 0.0  # no fleet
