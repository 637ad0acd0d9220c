"""Attach a training run to a coordinator's fleet: the one way `sparecycles train --coordinator` and
`sparecycles up` get their probes from probe workers.

- `FleetSettings`: what the trainer needs besides the coordinator URL, from the environment only (the admin
  token never travels on a command line): SPARECYCLES_ADMIN_TOKEN, SPARECYCLES_REDIS_URL (the coordinator's
  Redis, whose result stream the trainer reads), SPARECYCLES_KEY_PREFIX.
- `attach(url, settings, wait_s)`: checks that the coordinator answers, that it accepts the admin token and
  that at least `min_workers` workers are active, waiting up to `wait_s` seconds (and saying so); raises
  `FleetError` with a message fit for a user otherwise.
- `Fleet.mode_factory`: a `trainer.train` mode factory that builds the run's ZO mode over a
  `fleet.backend.CoordinatorBackend` (a new coordinator run per attach; a resumed run re-publishes what the
  workers need, see trainer.zo.modes).
- `ROUND_MODES`: when a ZO-Curv round folds into the steps (trainer.zo.rounds.RoundBook): "async" (as it arrives),
  "sync" (at its own refresh: `train --fleet-sync`), "next" (at the refresh after it: `up`); the last two make a
  run independent of the fleet's timing, so an interrupted and resumed run equals the uninterrupted one.
- `FleetStatus` / `FleetFiguresMode`: live fleet figures (workers, probes/s, results by outcome) scraped from
  the coordinator's /metrics, shown in the progress line and added to every step's record (with
  `fleet_runs_recreated`: times the coordinator lost the run and the trainer created it again, fleet.recovery).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from coordinator.settings import env_var_of, secret_problem, url_password_problem
from wire import bounds

COUNTDOWN_EVERY_S = 10.0  # while waiting for the coordinator, a line saying so every this many seconds
REFUSED_TRIES = 10  # tries 0.5 s apart, each refused: nothing listens on that port (a restart takes less)


class FleetError(RuntimeError):
    """The fleet cannot be used: coordinator unreachable, token refused, or no active worker in time."""


class FleetSettings(BaseSettings):
    """The trainer's fleet credentials, read from the environment (prefix SPARECYCLES_).

    admin_token: the coordinator's admin token (creates runs, publishes versions and rounds).
    redis_url: the Redis/Valkey holding the coordinator's result streams.
    key_prefix: the coordinator's key prefix (its SPARECYCLES_KEY_PREFIX).
    blob_dir: the coordinator's blob directory (its SPARECYCLES_BLOB_DIR) when the trainer shares its file
        system (`up`, compose's `blobs` volume): weight shards are written there instead of uploaded over HTTP.
    dev_mode: SPARECYCLES_DEV_MODE, as the coordinator's: accept any token.
    Raises pydantic.ValidationError when the token or the Redis URL is missing, or (outside dev mode) when the
    token is empty, short, a default or a placeholder, or the URL's password a placeholder
    (coordinator.settings.secret_problem).
    """

    model_config = SettingsConfigDict(env_prefix="SPARECYCLES_", extra="ignore", env_ignore_empty=True)

    dev_mode: bool = False  # first: the validators below read it
    admin_token: SecretStr = Field(min_length=1)
    redis_url: str = Field(min_length=1, pattern=r"^(redis|rediss|unix)://")

    @field_validator("admin_token")
    @classmethod
    def _refuse_weak_token(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        problem = None if info.data.get("dev_mode") else secret_problem(value.get_secret_value())
        if problem:
            raise ValueError(f"it {problem}")
        return value

    @field_validator("redis_url")
    @classmethod
    def _refuse_placeholder_password(cls, value: str, info: ValidationInfo) -> str:
        problem = None if info.data.get("dev_mode") else url_password_problem(value)
        if problem:
            raise ValueError(f"it {problem}")
        return value
    key_prefix: str = Field(default="sc", pattern=r"^[A-Za-z0-9_-]{1,32}$")
    blob_dir: Path | None = None


def load_settings() -> FleetSettings:
    """FleetSettings from the environment. Raises FleetError naming every variable missing or refused (never its
    value): `train --coordinator` calls it with its option checks, before anything starts."""
    from pydantic import ValidationError

    try:
        return FleetSettings()
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        missing = [env_var_of(FleetSettings, str(e["loc"][0])) for e in errors if e["type"] == "missing"]
        invalid = [f"{env_var_of(FleetSettings, str(e['loc'][0]))} ({e['msg'].removeprefix('Value error, ')})"
                   for e in errors if e["type"] != "missing"]
    why = []
    if missing:
        why.append(f"needs {', '.join(missing)} in the environment (the coordinator's admin token and its Redis "
                   "URL; never on the command line)")
    if invalid:
        why.append(f"has an invalid {', '.join(invalid)}")
    raise FleetError(f"a fleet run {'; '.join(why)}")


def active_workers(base: str, admin_token: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Active workers of the coordinator at `base` (every page of GET /v1/workers).

    Raises FleetError for a refused token (401/403) or another error status; httpx.HTTPError when the
    coordinator does not answer.
    """
    out: list[dict[str, Any]] = []
    after = ""
    while True:
        r = httpx.get(f"{base}/v1/workers", params={"after": after, "limit": 1000} if after else {"limit": 1000},
                      headers={"Authorization": f"Bearer {admin_token}"}, timeout=timeout_s)
        if r.status_code in (401, 403):
            raise FleetError(f"the coordinator at {base} refused the admin token ({r.status_code}); set "
                             "SPARECYCLES_ADMIN_TOKEN to its admin token")
        if r.status_code != 200:
            raise FleetError(f"GET {base}/v1/workers answered {r.status_code}: {r.text[:200]}")
        out.extend(w for w in r.json() if w.get("state") == "active")
        after = r.headers.get("X-Next-After", "")
        if not after:
            return out


def wait_for_workers(base: str, admin_token: str, n: int, wait_s: float, *,
                     check: Callable[[], None] = lambda: None, log: Callable[[str], None] = lambda m: None,
                     poll_s: float = 0.3) -> list[dict[str, Any]]:
    """Wait up to `wait_s` seconds until `n` workers are active; returns them.

    `check()` runs every poll (e.g. a supervisor raising when a child died); `log` gets one line when the
    wait starts (so a user knows why nothing happens). Raises FleetError after `wait_s` seconds or on a
    refused token; transient HTTP errors are retried until the deadline.
    """
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        check()
        try:
            workers = active_workers(base, admin_token)
            if len(workers) >= n:
                return workers
        except httpx.HTTPError:
            workers = []
        if time.monotonic() >= deadline:
            raise FleetError(f"{len(workers)} of {n} probe worker(s) active at {base} after {wait_s:.0f} s; start "
                             "workers with `sparecycles worker --coordinator URL` (or raise --attach-wait)")
        if not said:
            log(f"waiting up to {wait_s:.0f} s for {n} active probe worker(s) at {base} ({len(workers)} now)")
            said = True
        time.sleep(poll_s)


class FleetStatus:
    """Live fleet figures from the coordinator's /metrics: workers, probes/s, stale-result rate.

    Scrapes go through one pooled httpx.Client: a bare `httpx.get` builds a client (and its TLS context) per
    call, ~50 ms against a local coordinator here (3.6 ms pooled), paid on every training step by
    FleetFiguresMode (the x2 experiment's run: 0.136 s per fleet step vs 0.075 s in process).
    """

    def __init__(self, base: str) -> None:
        self.base, self.t0, self.accepted0, self.most_workers = base, time.monotonic(), None, 0.0
        self.last: dict[str, float] = {}
        self.client = httpx.Client(timeout=1.0)

    def snapshot(self) -> dict[str, float]:
        """Scrape once: active workers (the most seen in any scrape: `most_workers`), tasks published and re-issued
        (the coordinator's counters since it started), results by outcome, accepted results/s since start."""
        from prometheus_client.parser import text_string_to_metric_families

        # Only a 200 in Prometheus text is parsed: a 503 (an older coordinator while Redis is down)
        # carries JSON, and any unparsable scrape keeps the last figures rather than ending the run.
        try:
            r = self.client.get(f"{self.base}/metrics")
        except httpx.HTTPError:
            return self.last
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/plain"):
            return self.last
        snap: dict[str, float] = {"workers": 0.0, "tasks_published": 0.0, "tasks_redispatched": 0.0}
        try:
            for fam in text_string_to_metric_families(r.text):
                for s in fam.samples:
                    if s.name == "sparecycles_workers" and s.labels.get("state") == "active":
                        snap["workers"] += s.value
                    elif s.name == "sparecycles_tasks_published_total":
                        snap["tasks_published"] = s.value
                    elif s.name == "sparecycles_tasks_redispatched_total":  # every reason: a stalled round's
                        snap["tasks_redispatched"] += s.value  # seeds re-issued (coordinator.deadlines)
                    elif s.name == "sparecycles_intake_results_total":
                        snap[f"results_{s.labels.get('outcome', '?')}"] = s.value
        except ValueError:
            return self.last
        accepted = snap.get("results_accepted", 0.0)
        if self.accepted0 is None:
            self.accepted0, self.t0 = accepted, time.monotonic()
        snap["seconds"] = time.monotonic() - self.t0
        snap["probes_per_s"] = (accepted - self.accepted0) / max(1e-9, snap["seconds"])
        total = sum(v for k, v in snap.items() if k.startswith("results_"))
        snap["stale_fraction"] = snap.get("results_stale", 0.0) / total if total else 0.0
        self.last, self.most_workers = snap, max(self.most_workers, snap["workers"])
        return snap

    def __call__(self) -> str:
        s = self.last or self.snapshot()  # the step just taken scraped it (FleetFiguresMode)
        if not s:
            return "coordinator unreachable"
        return (f"workers {s['workers']:.0f} | probes/s {s['probes_per_s']:.1f} | "
                f"stale {100 * s['stale_fraction']:.1f}%")


class FleetFiguresMode:
    """A TrainMode (trainer.train) that adds the fleet's figures to every step's record, so probes/s, active
    workers and results by outcome land in metrics.jsonl and the TensorBoard events: `fleet_<key>` for each key
    of `FleetStatus.snapshot()` (one scrape of the coordinator's /metrics per step). Everything else is the
    wrapped mode's. `recovery` (a recoverable fleet.backend.CoordinatorBackend): its count of run re-creations is added as
    `fleet_runs_recreated`. It reports to the run's health (trainer.health): the run is fleet-probed, and active
    workers falling below the most seen this run are `workers_lost` (one warning per fall, counting the workers)."""

    def __init__(self, mode, status: FleetStatus, recovery=None) -> None:
        from trainer import health

        self.mode, self.status, self.recovery = mode, status, recovery
        self.optimizer = mode.optimizer
        self.peak_workers = 0.0  # the most active workers seen this run
        self._low: float | None = None  # the fewest seen since the peak (workers_lost already reported down to it)
        if (h := health.current()) is not None:
            h.fleet_probes = True

    def extra_state(self):
        """The wrapped mode's."""
        return self.mode.extra_state()

    def load_extra_state(self, tensors, meta) -> None:
        """The wrapped mode's."""
        self.mode.load_extra_state(tensors, meta)

    def step(self, step: int, batch, lr: float) -> dict[str, float]:
        stats = self.mode.step(step, batch, lr)
        snap = self.status.snapshot()
        if "workers" in snap:
            self._watch_workers(step + 1, snap["workers"])
        out = {**stats, **{f"fleet_{k}": float(v) for k, v in snap.items()}}
        return out if self.recovery is None else {**out, "fleet_runs_recreated": float(self.recovery.recreated)}

    def _watch_workers(self, step: int, workers: float) -> None:
        """Report `workers_lost` when the active workers (the coordinator's count: a killed worker leaves it when its
        lease expires) fall below the peak and below the last count reported."""
        from trainer import health

        if workers >= self.peak_workers:
            self.peak_workers, self._low = workers, None
            return
        floor = self.peak_workers if self._low is None else self._low
        if workers < floor:
            health.warn("workers_lost", f"active probe workers fell from {self.peak_workers:.0f} to {workers:.0f} "
                        f"at step {step}", step=step, count=int(floor - workers))
            self._low = workers

    def close(self, wait: bool = True) -> None:
        """Close the mode's CoordinatorBackend (`CoordinatorBackend.close`): its last uploads' errors surface here
        when `wait`; trainer.train calls this when the run ends, however it ends: the run's rounds are cancelled on
        the coordinator (workers idle within one control interval; a resume attaches a new coordinator run)."""
        self.mode.backend.close(wait=wait, end=True)


ROUND_MODES = ("async", "sync", "next")  # when a fleet's ZO-Curv rounds fold: trainer.zo.rounds.FOLD_TIMINGS


@dataclass
class Fleet:
    """A coordinator this trainer attached to (see `attach`). `workers` is the number of active workers
    seen at attach time (pure-ZO rounds split their seeds over that many tasks)."""

    base: str
    settings: FleetSettings
    workers: int
    status: FleetStatus
    run_prefix: str = "train"
    rounds: str = "async"
    share: float = 1.0  # each coordinator run of this trainer states it (RunSpec.share; coordinator.share_math)

    def probe_backend(self, cfg, model):
        """The run's probe backend on this fleet: a fleet.backend.CoordinatorBackend on a new coordinator run,
        made `recoverable` (fleet.recovery; what `mode_factory` and sparecycles.loop.ZOCurv use).

        Raises ValueError for a method whose probes cannot go to a fleet (trainer.methods: none, or its
        `no_fleet_why`) and CoordinatorHTTPError when the coordinator refuses the run.
        """
        from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress
        from trainer.methods import fleet_method_names, get_method
        from trainer.models.causal_lm import model_label
        from wire.messages import RunSpec, share_fields

        method = get_method(cfg.optimizer)
        if cfg.optimizer not in fleet_method_names():
            raise ValueError(f"{cfg.optimizer} sends no probes to a fleet {method.no_fleet_why}".rstrip())
        pure = method.kind == "pure-zo"
        lm = getattr(cfg, "task", "lm") != "sentiment"
        # The workers build the model from the manifest (class + config + shards) and pick the loss and batch
        # format from its class, exactly as the backend does here.
        # A fleet of one worker cannot spot-check: a replica must come from another worker, so the coordinator
        # re-sends it to the same one until it gives up (the x2 experiment's run: 62 refused re-evaluations for 3
        # spot-checked seeds, their rounds folded up to 72 steps late). Spot checks start at two workers.
        spec = RunSpec(run=f"{self.run_prefix}-{secrets.token_hex(4)}", model_class=type(model).__name__,
                       model_preset=model_label(cfg.model) if lm else None, staleness=cfg.staleness, **share_fields(self.share),
                       **({"spot_check_fraction": 0.0} if self.workers < 2 else {}),
                       **({"seeds_per_task": max(1, -(-cfg.probes // max(1, self.workers)))} if pure else {}))
        # ZO-Curv steps publish inside their steps: their backend serialises and uploads in the background
        # (fleet.backend); pure-ZO steps wait for each round anyway.
        backend = CoordinatorBackend.connect(model, spec, FleetAddress.of(self.base, self.settings),
                                             BackendTuning(history=0 if pure else 2, background=not pure,
                                                           blob_dir=self.settings.blob_dir))
        return backend.recoverable(spec)  # outlives a coordinator whose store comes back empty

    def mode_factory(self, cfg, model, loss_fn=None):
        """trainer.train's `mode_factory`: the run's ZO mode (cfg.optimizer) with its probes on the fleet, its
        ZO-Curv rounds folding as `rounds` says (trainer.zo.rounds.RoundBook; pure-ZO steps wait for theirs).
        `loss_fn(model, batch)`: the trainer's own loss for its steps when it is not the loss the workers evaluate
        (a --teacher run's (1-a) CE + a KD, trainer.kd); None: that loss (the model kind's CE, trainer.batch_losses).

        Raises ValueError for a method whose probes cannot go to a fleet (trainer.methods: none, or its
        `no_fleet_why`) and CoordinatorHTTPError when the coordinator refuses the run.
        """
        from trainer.batch_losses import loss_for_kind
        from trainer.mode_builders import build_mode
        from wire.batch import batch_kind_for_model

        backend = self.probe_backend(cfg, model)
        loss_fn = loss_fn or loss_for_kind(batch_kind_for_model(type(model).__name__))
        mode = build_mode(cfg, model, loss_fn, backend=backend, timing=self.rounds)
        return FleetFiguresMode(mode, self.status, backend)

    def evaluator_factory(self, deadline_s: float = 120.0, full: bool = False):
        """trainer.train's `evaluator_factory`: held-out evaluation on this fleet (fleet.evaluation.FleetEvaluator,
        a coordinator run of its own); `full`: the whole validation split, else (default) the run's `eval_batches`
        subset, the windows the trainer evaluates;
        `deadline_s`: seconds without a result before the trainer evaluates a version itself."""
        def make(task, cfg, model, mode):
            from fleet.evaluation import FleetEvaluator

            return FleetEvaluator(task, cfg, model, self, deadline_s=deadline_s, full=full)

        return make


def check_key_prefix(settings: FleetSettings) -> None:
    """Check that the coordinator's state lives under `settings.key_prefix` in `settings.redis_url`: its set of
    registered workers (coordinator.keys.Keys.k_workers) exists there once a worker joined. A wrong prefix would
    otherwise make the trainer wait on a result stream nobody writes.

    Raises FleetError when Redis is unreachable from here or holds no such key (the message never shows the URL,
    which may carry a password).
    """
    import redis

    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        found = client.exists(f"{settings.key_prefix}:workers")
        client.close()
    except redis.RedisError as exc:
        raise FleetError(f"the coordinator's Redis (SPARECYCLES_REDIS_URL) is not reachable from here: "
                         f"{type(exc).__name__}") from None
    if not found:
        raise FleetError(f"no coordinator state under key prefix {settings.key_prefix!r} in SPARECYCLES_REDIS_URL: "
                         "set SPARECYCLES_KEY_PREFIX to the coordinator's own (its workers would be registered there)")


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during (__cause__, else __context__), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def no_such_host(exc: BaseException) -> bool:
    """True when `exc` (an httpx error) was caused by a host name that does not resolve (getaddrinfo's EAI_NONAME or
    EAI_NODATA): a permanent error. A temporary resolver failure (EAI_AGAIN) or a refused connection is not."""
    import socket

    permanent = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}
    return any(isinstance(e, socket.gaierror) and e.errno in permanent for e in _causes(exc))


def connection_refused(exc: BaseException) -> bool:
    """True when `exc` (an httpx error) was caused by a refused connection: the host answers, no one listens."""
    return any(isinstance(e, ConnectionRefusedError) for e in _causes(exc))


def attach(url: str, *, settings: FleetSettings | None = None, wait_s: float = 120.0, min_workers: int = 1,
           check: Callable[[], None] = lambda: None, log: Callable[[str], None] = lambda m: None,
           run_prefix: str = "train", rounds: str = "async", share: float = 1.0) -> Fleet:
    """Connect to the coordinator at `url` and wait for `min_workers` active workers (at most `wait_s` s).

    `settings` default to the environment (FleetSettings); `rounds` (ROUND_MODES): when ZO-Curv rounds fold ("async"
    as they arrive, "sync" at their refresh, "next" at the one after); `share`: each of its runs' (wire.bounds.Share).
    Raises FleetError when the coordinator does not answer /readyz (at once for a host name that does not resolve,
    `no_such_host`; after REFUSED_TRIES refused connections in a row, ~5 s, for a port no one listens on; otherwise
    one bounded retry loop of `wait_s` seconds: `log` says so at the first failure and counts down every
    COUNTDOWN_EVERY_S seconds), refuses the admin token, or has too few active workers after `wait_s` seconds;
    ValueError for a URL that is not http(s) or a share out of bounds.
    """
    base, share = url.rstrip("/"), bounds.check_share(share)
    if rounds not in ROUND_MODES:
        raise ValueError(f"rounds must be one of {ROUND_MODES}, got {rounds!r}")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--coordinator must be an http(s) URL, got {url!r}")
    if settings is None:
        settings = load_settings()
    deadline = time.monotonic() + wait_s
    said_at: float | None = None
    refused = 0
    while True:
        check()
        try:
            r = httpx.get(f"{base}/readyz", timeout=5.0)
            if r.status_code == 200:
                break
            why = f"/readyz answered {r.status_code}"
        except httpx.HTTPError as exc:
            if no_such_host(exc):  # permanent: retrying for wait_s seconds cannot make the name resolve
                raise FleetError(f"the coordinator at {base}: no such host ({exc}); check the host name in "
                                 "--coordinator (or SPARECYCLES_COORDINATOR_URL)") from None
            why = f"{type(exc).__name__}: {exc}"
            refused = refused + 1 if connection_refused(exc) else 0
            if refused >= REFUSED_TRIES:
                raise FleetError(f"the coordinator at {base}: connection refused {refused} times in a row (nothing listens "
                                 "there); check the port in --coordinator and that the coordinator runs") from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise FleetError(f"the coordinator at {base} is not reachable or not ready after {wait_s:.0f} s ({why})")
        if said_at is None:  # at once, then a countdown
            log(f"the coordinator at {base} is not reachable or not ready ({why}); retrying for up to {wait_s:.0f} s "
                "(--attach-wait)")
            said_at = time.monotonic()
        elif time.monotonic() - said_at >= COUNTDOWN_EVERY_S:
            log(f"  still not reachable; giving up in {left:.0f} s")
            said_at = time.monotonic()
        time.sleep(min(0.5, left))
    token = settings.admin_token.get_secret_value()
    try:
        active_workers(base, token)  # token check first: a refused token must not look like an empty fleet
    except httpx.HTTPError as exc:
        raise FleetError(f"the coordinator at {base} stopped answering: {exc}") from None
    workers = wait_for_workers(base, token, min_workers, max(0.0, deadline - time.monotonic()), check=check, log=log)
    check_key_prefix(settings)
    return Fleet(base, settings, len(workers), FleetStatus(base), run_prefix, rounds, share)
