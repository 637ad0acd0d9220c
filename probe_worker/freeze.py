"""Freezing a worker's task the moment its serving engine reads busy: a watcher process, outside the worker's lowered
priority, stops the worker (SIGSTOP) and continues it (SIGCONT).

Why a process of its own: beside an engine, a worker's tasks and its session's autogroup run at nice 19
(probe_worker.priority), so while the engine serves, every thread of the worker, its in-process engine watch
included, gets ~1.5% of the core. A cut (a check at the task's next module call, probe_worker.serving) then takes
effect only after the engine's request: measured 5.8 s p95 on CPU (docs/serving.md). A stopped process needs no CPU
to stop. The watcher runs in a session of its own (its own autogroup) at the normal priority and does one thing:
while the worker runs a task and the engine reads busy, the worker is stopped. It is continued when

- the engine reads idle (the task goes on where it stopped; the in-process gate decides whether to cut it),
- a signal is pending for it (SIGTERM, SIGINT, SIGUSR1: its shutdown and drains are never held up),
- it has been stopped for `max_s` (its heartbeats and lease; it then cuts the task itself, as without a watcher,
  and is not stopped again until the engine has read idle once), or
- the watcher ends (SIGTERM, its parent gone, an error): never leaves the worker stopped.

An unreadable engine never stops the worker (the in-process watch yields on it). A worker that is PID 1 of its
container gets no watcher (`why_no_watcher`: the kernel drops a SIGSTOP sent to a namespace's init from inside it).
A stop takes effect when each of the worker's threads next enters the kernel or is scheduled: at nice 19 beside a
busy engine that is a time slice away, not the rest of a forward.

Shared memory (a memfd of SHARED.size bytes the worker creates and the watcher inherits): the running task's start
(unix s; 0.0: none), written by the worker; when the watcher first stopped the worker during that task (unix s;
0.0: not stopped), written by the watcher and cleared by the worker at each task start. The watcher also traces each
stop and continue ({"event": "freeze"|"thaw", "t": unix s}) to the worker's task trace, which `bench serving` reads.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from probe_worker.serving import EngineProbe, ServingPolicy, Unreadable
from probe_worker.task_trace import TraceFile

log = logging.getLogger("sparecycles.freeze")
SHARED = struct.Struct("<dd")  # (task start, first stop in that task), unix seconds, 0.0 for none


class FreezeOrders(BaseModel):
    """What the watcher process is told (argv[1], JSON): the worker's pid, the shared memory's fd, the engine's policy,
    seconds between readings while the worker runs a task and while it is stopped, the longest stop (seconds) and where
    to trace. Strict: an unknown field is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(gt=1)
    fd: int = Field(ge=0)
    policy: ServingPolicy
    interval_s: float = Field(ge=0.01, le=3600.0, allow_inf_nan=False)
    stopped_interval_s: float = Field(ge=0.01, le=3600.0, allow_inf_nan=False)
    max_s: float = Field(gt=0.0, le=3600.0, allow_inf_nan=False)
    trace: Path | None = None


def watcher_rates(serving_interval_s: float | None, control_interval_s: float, max_s: float) -> tuple[float, float]:
    """The watcher's seconds between readings while the worker runs a task and while it is stopped: the worker's own
    watch's two rates (ServingWatch.run: --serving-interval, else --control-interval; the larger of it and
    --control-interval), neither slower than the longest stop `max_s` (seconds, all three)."""
    fast = serving_interval_s or control_interval_s
    slow = min(max(fast, control_interval_s), max_s)
    return min(fast, slow), slow


class FreezeLink:
    """The worker's end: creates the shared memory, starts the watcher (`python -m probe_worker.freeze`) in a session
    of its own, and marks its tasks' starts and ends. `close()` ends the watcher (which continues the worker first).
    `interval_s`: the seconds between readings while a task runs and while the worker is stopped (watcher_rates);
    `max_s`: the longest stop; `trace`: the worker's task trace, or None.

    Linux only (memfd, /proc). Raises OSError where a memfd or the process cannot be made.
    """

    def __init__(self, policy: ServingPolicy, interval_s: tuple[float, float], max_s: float,
                 trace: Path | None = None) -> None:
        self.fd = os.memfd_create("sparecycles-freeze", os.MFD_CLOEXEC)  # the watcher alone inherits it (pass_fds)
        os.ftruncate(self.fd, SHARED.size)
        self._shared = mmap.mmap(self.fd, SHARED.size)
        orders = FreezeOrders(pid=os.getpid(), fd=self.fd, policy=policy, interval_s=interval_s[0],
                              stopped_interval_s=max(interval_s), max_s=max_s,
                              trace=trace)
        # Its own session: its own autogroup at nice 0 (the worker's is lowered next) and out of the terminal's Ctrl-C
        # (the worker's SIGINT reaches it through the worker: pending signals continue the worker, and close() ends it).
        self.proc = subprocess.Popen([sys.executable, "-m", "probe_worker.freeze", orders.model_dump_json()],
                                     pass_fds=(self.fd,), start_new_session=True, stdin=subprocess.DEVNULL)

    def task_started(self) -> None:
        """The calling worker starts a task now (clears the last task's stop)."""
        SHARED.pack_into(self._shared, 0, time.time(), 0.0)

    def task_ended(self) -> None:
        """The worker's task ended (however it ended); its stop is kept until the next task starts."""
        struct.pack_into("<d", self._shared, 0, 0.0)

    def stopped_at(self) -> float | None:
        """When the watcher first stopped the worker during the running (or last) task (unix s), None if it did not."""
        first = SHARED.unpack_from(self._shared, 0)[1]
        return first or None

    def close(self, timeout_s: float = 5.0) -> None:
        """End the watcher (SIGTERM, then SIGKILL after `timeout_s`) and free the shared memory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._shared.close()
        os.close(self.fd)


def why_no_watcher() -> str | None:
    """Why this process must not be stopped by a watcher, None if it may: it must lead its session (as for its
    autogroup, probe_worker.priority). A terminal's job that stops shows as stopped, and the shell takes the terminal
    back."""
    if os.getpid() == 1:  # the kernel drops a SIGSTOP sent to a namespace's init from inside it
        return "this worker is PID 1 of its container, which a stop signal from inside it cannot stop: run it under an init"
    if os.getsid(0) != os.getpid():
        return ("this worker shares its session (a terminal's, a script's), where a stop would show as a stopped job: "
                "start it as a session of its own (a service manager, or `setsid -w sparecycles worker ...`, stopped "
                "with SIGTERM)")
    return None


STOPS = frozenset({signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})  # the watcher's own
ENDINGS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})  # the worker is asked to end
TAKEN = frozenset({signal.SIGUSR1, signal.SIGUSR2})  # blocked by the worker and taken by its sigwait (drain_signals)


def pending_signals(pid: int) -> frozenset[int]:
    """The signals pending for the process that it has not blocked (/proc/PID/status: SigPnd of its main thread or
    ShdPnd, the process's, less SigBlk; the drain signals count though blocked: TAKEN), less the stop and continue signals (STOPS: the watcher's own SIGSTOP stays
    pending until the worker's threads next run). Empty when the process is gone."""
    masks = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("SigPnd", "ShdPnd", "SigBlk"):
                masks[key] = int(value.strip(), 16)
    except (OSError, ValueError):
        return frozenset()
    waited = sum(1 << (int(sig) - 1) for sig in TAKEN)  # blocked, yet taken at once by the worker's sigwait
    bits = (masks.get("SigPnd", 0) | masks.get("ShdPnd", 0)) & ~(masks.get("SigBlk", 0) & ~waited)
    return frozenset(n for n in range(1, 65) if bits >> (n - 1) & 1) - STOPS


def process_state(pid: int) -> str | None:
    """The process's state letter in /proc/PID/stat (R, S, T: stopped, Z: zombie, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:][:1]


def is_stopped(pid: int) -> bool:
    """Whether the process is in the stopped state ('T' in /proc/PID/stat). False when it is gone."""
    return process_state(pid) == "T"


class Watcher:
    """The watcher's state machine over one reading (`step`); `run` loops it. Pure apart from the signals it sends,
    the shared memory it reads and the trace it writes (each a constructor argument, so a test can drive it)."""

    def __init__(self, orders: FreezeOrders, shared, send=os.kill, trace: TraceFile | None = None) -> None:
        self.orders, self.shared, self.send, self.trace = orders, shared, send, trace
        self.since: float | None = None  # when the current stop began (monotonic s), None while the worker runs
        self.spent = False  # a stop ran to max_s (or a signal came) in this busy spell: none other until idle is read
        self.ending = False  # a signal asked the worker to end (ENDINGS): never stopped again

    def step(self, now: float, busy: bool, task: bool, pending: frozenset[int] = frozenset()) -> None:
        """One look at monotonic `now`: `busy`, the engine has requests (the last reading); `task`, the worker runs a
        task; `pending`, the signals waiting for it (pending_signals). Stops or continues the worker (module docstring):
        a signal continues it and it is not stopped again in that busy spell (it acts on the signal: a drain, a
        shutdown that waits for the task), and never again once asked to end."""
        self.ending = self.ending or bool(pending & ENDINGS)
        if not busy:
            self.spent = False
        if self.since is None:
            if busy and task and not pending and not self.spent and not self.ending:
                self._stop(now)
        elif not busy or pending or self.ending or now - self.since >= self.orders.max_s:
            self.spent = busy
            self.thaw()

    def _stop(self, now: float) -> None:
        self.send(self.orders.pid, signal.SIGSTOP)
        self.since, wall = now, time.time()
        if SHARED.unpack_from(self.shared, 0)[1] == 0.0:
            struct.pack_into("<d", self.shared, 8, wall)  # the task's first stop, which reclaim latency ends at
        if self.trace is not None:
            self.trace.event("freeze", wall)

    def thaw(self) -> None:
        """Continue the worker if it is stopped (idempotent). The trace line is written first: whoever sees the worker
        running again (it reads its trace, `bench serving`, a test) finds the thaw already there."""
        if self.since is None:
            return
        if self.trace is not None:
            self.trace.event("thaw", time.time())
        self.send(self.orders.pid, signal.SIGCONT)
        self.since = None

    def run(self) -> None:
        """Read the engine every interval while the worker runs a task or is stopped, until the worker is gone; continue
        it on the way out."""
        probe, pid = EngineProbe(self.orders.policy), self.orders.pid
        busy, next_read = False, 0.0
        try:
            while os.getppid() == pid:
                task, now = SHARED.unpack_from(self.shared, 0)[0] > 0.0, time.monotonic()
                if not task and self.since is None:  # nothing to stop: no reading (each costs the engine ~2 ms)
                    time.sleep(self.orders.interval_s)
                    continue
                # while stopped only the engine's return to idle is looked for: a reading every stopped_interval_s,
                # each of which costs the engine's API server CPU while it serves (the worker's own watch slows so
                # too, ServingWatch.next_wait); signals and max_s are looked at every interval_s (/proc, no engine)
                if self.since is None or now >= next_read:
                    try:
                        busy = probe.read() > self.orders.policy.busy_above
                    except Unreadable:
                        busy = False
                    next_read = now + self.orders.stopped_interval_s
                self.step(now, busy, task, pending_signals(pid))
                time.sleep(self.orders.interval_s)
        finally:
            self.thaw()
            probe.close()


def main(argv: list[str]) -> int:
    """The watcher process: `python -m probe_worker.freeze ORDERS_JSON` (FreezeOrders). Exit 2 for bad orders."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per reading
    try:
        orders = FreezeOrders.model_validate_json(argv[1] if len(argv) > 1 else "")
    except ValueError as exc:
        print(f"probe_worker.freeze: bad orders: {exc}", file=sys.stderr)
        return 2
    watcher = Watcher(orders, mmap.mmap(orders.fd, SHARED.size),
                      trace=TraceFile(orders.trace) if orders.trace else None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through run's finally: the worker is continued
    watcher.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
