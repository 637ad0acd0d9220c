"""`sparecycles bench churn`: a trainer on a local fleet whose workers come and go on a seeded schedule.

One arm per `--fleet-wait` (sync, interval, never), each with churn and (`--baseline`) without: a coordinator process
on `--redis-url` (a key prefix of its own, short leases so a stopped worker is found out within seconds) and N CPU
`sparecycles worker` processes (the layers keep benchmarks from sparecycles.local_fleet: the same commands, started
here), then `sparecycles train --coordinator` (ZO-Curv, zocurv-line) while every `--every-s` seconds one event
strikes, chosen by a seeded generator: `kill` (SIGKILL a worker), `term` (SIGTERM: its warm shutdown), `stop`
(SIGSTOP past its lease, then SIGCONT), `join` (a new worker process), `yield` (SIGUSR1: the worker stops taking
tasks, as for a serving burst, until SIGUSR2 `--stop-s` later), `restart` (the coordinator stopped by SIGTERM and
started again on the same port and Redis) or `redis` (with it among the events each arm has a Redis of its own,
append-only: benchmarks.churn_redis; SHUTDOWN and started again). The pool stays between 1 and N live workers (a removal with one left
becomes a join, a join with N live a removal; `--replace`, the default, starts a killed or terminated worker's
replacement at once, as a replica set does); the schedule starts once the trainer has attached (its coordinator
run exists). A restart zeroes the coordinator's in-memory counters: the bench adds what they read before it. Once per second the bench samples the
coordinator (active workers, rounds open); the figures (benchmarks.churn_report) come from the coordinator's counters,
its Redis (every round and every stream event of the run) and the workers' logs. The in-process run of the same
settings is the reference of the `sync` arms' losses (bit for bit).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.churn_redis import OwnRedis

Wait = Literal["sync", "interval", "never"]
Event = Literal["kill", "term", "stop", "join", "yield", "restart", "redis"]
RESTARTS = ("restart", "redis")  # the coordinator's, the Redis's: always possible
REMOVALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP, "yield": signal.SIGUSR1}
# A paused worker's signal back: SIGCONT after `stop`, SIGUSR2 (the end of an operator drain) after `yield`.
RESUME = {"stop": signal.SIGCONT, "yield": signal.SIGUSR2}
REPLACED = ("kill", "term")  # removals for good: with --replace each starts its replacement at once
# Short leases and timeouts (the coordinator's environment) so churn is found out in seconds, as in the fleet tests.
FAST_FLEET = {"SPARECYCLES_LEASE_SECONDS": "4", "SPARECYCLES_HEARTBEAT_INTERVAL_S": "0.5",
              "SPARECYCLES_REAPER_INTERVAL_S": "0.2", "SPARECYCLES_VISIBILITY_TIMEOUT_S": "20",
              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class ChurnOptions(BaseModel):
    """`bench churn`'s options. Raises pydantic.ValidationError for a value outside its bound."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(4, ge=2, le=16, description="CPU probe workers at the start (and at most)")
    every_s: float = Field(10.0, gt=0, description="Seconds between churn events")
    seed: int = Field(0, description="Seed of the event schedule (which event, which worker)")
    waits: tuple[Wait, ...] = Field(("sync", "interval", "never"), min_length=1,
                                    description="Comma-separated --fleet-wait policies, one arm each")
    events: tuple[Event, ...] = Field(("kill", "term", "stop", "join"), min_length=1,
                                      description="Comma-separated event kinds drawn from: kill, term, stop, join, "
                                      "yield, restart, redis")
    stop_s: float = Field(6.0, gt=0, description="Seconds a stopped worker stays stopped (past its 4 s lease), and a "
                          "yielding one yields")
    replace: bool = Field(True, description="Keep the pool at --workers, as a replica set does: a worker killed or "
                          "terminated is replaced at once (a new worker process starts as it goes); off: every event "
                          "is drawn freely and the pool may fall to one worker")
    baseline: bool = Field(True, description="Also run each policy without churn (wall time's reference)")
    steps: int = Field(120, ge=4, description="Trainer steps per arm")
    curvature_interval: int = Field(2, ge=1, description="Steps per ZO-Curv round")
    probes: int = Field(8, ge=1, description="Probe seeds per round")
    batch_size: int = Field(4, ge=1, description="Trainer batch rows")
    seq_len: int = Field(32, ge=2, description="Trainer tokens per row")
    out: Path = Field(Path("results/churn"), description="Folder of churn.json and churn.png")
    work: Path | None = Field(None, description="Folder of the arms' runs, logs and blobs (default: a new temporary "
                              "folder, named in churn.json)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis of the arms' coordinators (each under a key "
                           "prefix of its own, deleted after the arm); with `redis` among the events each arm starts its own instead", json_schema_extra={"envvar": "REDIS_URL"})


@dataclass
class Pool:
    """The bench's view of the workers: names of live (not stopped or yielding) ones, paused ones (stopped or
    yielding) with their resume time and signal."""

    live: list[str] = field(default_factory=list)
    stopped: dict[str, tuple[float, signal.Signals]] = field(default_factory=dict)
    joined: list[str] = field(default_factory=list)
    started: int = 0


def trainer_args(o: ChurnOptions, run_dir: Path) -> list[str]:
    """`sparecycles train` arguments of every arm (the fleet's own added by the caller): evaluation on the trainer, so
    the fleet only answers probe rounds."""
    return ["train", "--preset", "demo", "--optimizer", "zocurv-line", "--steps", str(o.steps), "--batch-size",
            str(o.batch_size), "--seq-len", str(o.seq_len), "--curvature-interval", str(o.curvature_interval),
            "--probes", str(o.probes), "--eval-every", str(o.steps), "--eval-on", "trainer", "--no-export",
            "--no-progress", "--run-dir", str(run_dir), "--overwrite"]


def choose(rng: random.Random, events: tuple[str, ...], pool: Pool, cap: int, ready: set[str],
           replace: bool = False) -> str:
    """The next event: drawn from `events`. A removal (kill, term, stop, yield) strikes a worker in the pool (`ready`:
    registered and active at the coordinator, not one still starting) and leaves at least one: with fewer than two it
    becomes `join`; a `join` with `cap` workers started and not removed becomes a removal; "none" when neither is
    possible. `restart` (the coordinator) and `redis` are always possible. With `replace` (and `join` among
    `events`) a pool below `cap` gets `join` and a full one draws from the other events."""
    full = len(pool.live) + len(pool.stopped) >= cap
    if replace and "join" in events:
        if not full:
            return "join"
        events = tuple(e for e in events if e != "join") or events
    ev = rng.choice(events)
    if ev in RESTARTS:
        return ev
    removals = [e for e in events if e in REMOVALS]
    can_remove = bool(removals) and len(ready.intersection(pool.live)) >= 2
    can_join = "join" in events and not full
    if ev != "join" and not can_remove:
        return "join" if can_join else "none"
    if ev == "join" and not can_join:
        return removals[0] if can_remove else "none"
    return ev


def with_replacement(ev: str, replace: bool) -> tuple[str, ...]:
    """The events to apply for drawn event `ev`: with `replace`, a removal for good (kill, term) is followed at once by
    its replacement's `join`, as a replica set starts a new process as the old one goes; otherwise `ev` alone."""
    return (ev, "join") if replace and ev in REPLACED else (ev,)


def strike(ev: str, rng: random.Random, pool: Pool, site: Site, stop_s: float, ready: set[str]) -> str | None:
    """Apply event `ev` to a worker of `ready` chosen by `rng` (a new one for `join`; the coordinator for `restart`);
    returns the name of the process struck."""
    if ev == "none":
        return None
    if ev == "restart":
        site.restart_coordinator()
        return "coordinator"
    if ev == "redis" and site.own_redis is not None:
        site.own_redis.restart()
        return "redis"
    procs, start_worker = site.procs, site.start_worker
    if ev == "join":
        name = f"worker-{pool.started}"
        pool.started += 1
        start_worker(name)
        pool.live.append(name)
        pool.joined.append(name)
        return name
    name = rng.choice(sorted(ready.intersection(pool.live)))
    pool.live.remove(name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(procs[name].pid, REMOVALS[ev])
    if ev in RESUME:
        pool.stopped[name] = (time.monotonic() + stop_s, RESUME[ev])
    return name


def resume_due(pool: Pool, procs: dict) -> list[str]:
    """SIGCONT the stopped workers (SIGUSR2 the yielding ones) whose time is up; returns their names (live again)."""
    now, back = time.monotonic(), []
    for name, (at, sig) in list(pool.stopped.items()):
        if now >= at:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[name].pid, sig)
            del pool.stopped[name]
            pool.live.append(name)
            back.append(name)
    return back


@dataclass
class Site:
    """One arm's fleet: the coordinator's URL, the environments of the trainer (`env`: admin token, Redis URL and key
    prefix are read from it) and the workers (`worker_env`: no admin token, no Redis URL), its processes by name and the
    coordinator's counters as read before each restart of it (`counted`, summed: a restart starts them at 0)."""

    url: str
    env: dict[str, str]
    worker_env: dict[str, str]
    folder: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    counted: dict[str, dict[str, float]] = field(default_factory=dict)
    own_redis: OwnRedis | None = None

    @property
    def admin(self) -> str:
        """The coordinator's admin token (the trainer's environment holds it)."""
        return self.env["SPARECYCLES_ADMIN_TOKEN"]

    @property
    def redis_url(self) -> str:
        return self.env["SPARECYCLES_REDIS_URL"]

    @property
    def prefix(self) -> str:
        """The arm's Redis key prefix."""
        return self.env["SPARECYCLES_KEY_PREFIX"]

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start `sparecycles ARGS` as `name` (its own session, SIGTERM if this process dies; log in logs/)."""
        from probe_worker.engine import die_with_parent

        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.folder / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "sparecycles.cli", *args], env=env,
                                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, preexec_fn=die_with_parent)
        return self.procs[name]

    def start_coordinator(self) -> None:
        """The coordinator process on the port of `url`."""
        port = self.url.rsplit(":", 1)[1]
        self.start("coordinator", ["coordinator", "--port", port, "--log-level", "warning"], self.env)

    def restart_coordinator(self) -> None:
        """Read the coordinator's counters into `counted`, stop it (SIGTERM, SIGKILL after 20 s) and start it again.
        The workers' and the trainer's calls meanwhile meet a closed port and retry."""
        import httpx

        from benchmarks.churn_report import add_counts, counters

        with contextlib.suppress(httpx.HTTPError):
            with httpx.Client(base_url=self.url, timeout=10) as http:
                self.counted = add_counts(self.counted, counters(http))
        proc = self.procs["coordinator"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.start_coordinator()
        for _ in range(600):  # back within seconds; the samples skip the gap
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the restarted coordinator is not ready; see {self.folder / 'logs' / 'coordinator.log'}")

    def start_worker(self, name: str) -> None:
        self.start(name, ["worker", "--coordinator", self.url, "--name", name, "--device", "cpu", "--threads", "1",
                          "--keep-versions", "4", "--cache-dir", str(self.folder / "cache" / name)], self.worker_env)

    def stop_all(self) -> None:
        """SIGCONT, then SIGTERM every process (workers first, the coordinator last), SIGKILL after 20 s; delete the
        arm's Redis keys."""
        import redis

        for name in sorted(self.procs, key=lambda n: n == "coordinator"):
            proc = self.procs[name]
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.own_redis is not None:  # the arm's own: nothing to delete, only to stop
            self.own_redis.stop()
            return
        r = redis.Redis.from_url(self.redis_url)
        for pattern in (f"{self.prefix}*", f"_kombu.binding*.{self.prefix}*"):
            keys = list(r.scan_iter(pattern, count=1000))
            if keys:
                r.delete(*keys)
        r.close()


def start_site(o: ChurnOptions, folder: Path) -> Site:
    """A coordinator process (fresh random tokens, a key prefix of its own on `o.redis_url`, FAST_FLEET's leases)
    and `o.workers` worker processes; returns once every worker is active. Raises RuntimeError (naming the log) when
    the coordinator or the workers do not come up within 600 s."""
    from api.server import free_port
    from fleet.attach import FleetError, wait_for_workers

    prefix, port = "churn" + secrets.token_hex(4), free_port()
    own = OwnRedis(folder / "redis", free_port()) if "redis" in o.events else None
    redis_url = own.url if own is not None else o.redis_url
    env = {**os.environ, **FAST_FLEET, "SPARECYCLES_REDIS_URL": redis_url, "SPARECYCLES_KEY_PREFIX": prefix,
           "SPARECYCLES_QUEUE_PREFIX": f"{prefix}.probe", "SPARECYCLES_ADMIN_TOKEN": secrets.token_urlsafe(32),
           "SPARECYCLES_ENROLLMENT_TOKEN": secrets.token_urlsafe(32), "SPARECYCLES_BLOB_DIR": str(folder / "blobs")}
    env.pop("REDIS_URL", None)
    worker_env = {k: v for k, v in env.items() if k not in ("SPARECYCLES_REDIS_URL", "SPARECYCLES_ADMIN_TOKEN")}
    site = Site(f"http://127.0.0.1:{port}", env, worker_env, folder, own_redis=own)
    site.start_coordinator()
    for i in range(o.workers):
        site.start_worker(f"worker-{i}")

    def alive() -> None:
        if site.procs["coordinator"].poll() is not None:
            raise RuntimeError(f"the coordinator exited; see {folder / 'logs' / 'coordinator.log'}")

    try:
        wait_for_workers(site.url, site.admin, o.workers, 600.0, check=alive)
    except FleetError as exc:
        raise RuntimeError(f"{exc}; logs in {folder / 'logs'}") from exc
    return site


def run_arm(o: ChurnOptions, wait: str, churn: bool, folder: Path, log: Callable[[str], None]) -> dict:
    """One arm: a fresh fleet, the trainer with `--fleet-wait wait`, churn or not; returns its raw record
    (benchmarks.churn_report.figures reads it). Raises RuntimeError when the trainer fails."""
    import httpx
    import redis

    from benchmarks.churn_report import add_counts, sample, snapshot

    folder.mkdir(parents=True, exist_ok=True)
    rng, pool = random.Random(o.seed), Pool(live=[f"worker-{i}" for i in range(o.workers)], started=o.workers)
    site = start_site(o, folder)
    try:
        log(f"coordinator {site.url}, {o.workers} workers; logs in {folder / 'logs'}")
        trainer = site.start("trainer", [*trainer_args(o, folder / "run"), "--coordinator", site.url,
                                         "--fleet-wait", wait], site.env)
        t0, events, timeline, runs = time.time(), [], [], set()
        next_at = float("inf")  # the schedule starts once the trainer has attached (its coordinator run exists)
        with httpx.Client(base_url=site.url, headers={"Authorization": f"Bearer {site.admin}"}, timeout=30) as http:
            while trainer.poll() is None:
                for name in resume_due(pool, site.procs):
                    events.append({"t": time.time() - t0, "event": "cont", "worker": name})
                if churn and time.monotonic() >= next_at:
                    ready = set(timeline[-1]["active"]) if timeline else set()
                    ev = choose(rng, o.events, pool, o.workers, ready, o.replace)
                    for e in with_replacement(ev, o.replace):
                        name = strike(e, rng, pool, site, o.stop_s, ready)
                        events.append({"t": time.time() - t0, "event": e, "worker": name})
                    next_at += o.every_s
                with contextlib.suppress(httpx.HTTPError, redis.RedisError):  # restarting: no sample
                    timeline.append(sample(http, site, runs, time.time() - t0))
                if runs and next_at == float("inf"):
                    next_at = time.monotonic() + o.every_s
                time.sleep(1.0)
            wall = time.time() - t0
            final = snapshot(http, site, runs)
            final["metrics"] = add_counts(site.counted, final["metrics"])
        if trainer.returncode != 0:
            tail = (folder / "logs" / "trainer.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {wait} trainer exited {trainer.returncode}: {tail}")
    finally:
        site.stop_all()
    return {"wait": wait, "churn": churn, "wall_s": wall, "t0": t0, "events": events, "timeline": timeline,
            "final": final, "joined": pool.joined, "logs": str(folder / "logs"), "run_dir": str(folder / "run")}


def run_in_process(o: ChurnOptions, folder: Path) -> Path:
    """The same training without a fleet (probes in process): the reference of `sync`'s losses. Returns its run
    folder; raises RuntimeError when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARECYCLES_")}
    res = subprocess.run([sys.executable, "-m", "sparecycles.cli", *trainer_args(o, folder)], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the in-process run failed: {res.stderr[-2000:]}")
    return folder


def run_churn_bench(o: ChurnOptions, log: Callable[[str], None]) -> dict:
    """Every arm of `o` (churn, then without when `o.baseline`), the in-process reference, the figures; writes
    `o.out`/churn.json (after each arm) and churn.png. Returns the report (benchmarks.churn_report.report)."""
    import tempfile

    from benchmarks.churn_report import plot, report

    o.out.mkdir(parents=True, exist_ok=True)
    work = o.work or Path(tempfile.mkdtemp(prefix="sparecycles-churn-"))
    log(f"runs, logs and blobs in {work}")
    with _environ(FAST_FLEET):  # the in-process reference trains with the arms' thread count too
        reference = run_in_process(o, work / "in-process") if "sync" in o.waits else None
        arms: list[dict] = []
        for wait in o.waits:
            for churn in (True, False) if o.baseline else (True,):
                log(f"arm {wait} {'with' if churn else 'without'} churn")
                name = f"{wait}-{'churn' if churn else 'calm'}"
                arms.append(run_arm(o, wait, churn, work / name, log))
                (work / f"{name}.json").write_text(json.dumps(arms[-1], default=list))  # the raw record, kept
                rep = report(o, arms, reference)
                (o.out / "churn.json").write_text(json.dumps(rep, indent=1))
    plot([a for a in arms if a["churn"]], o.out / "churn.png")
    return rep


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set (local_fleet hands it to the coordinator and the workers), the
    previous values back on exit."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
