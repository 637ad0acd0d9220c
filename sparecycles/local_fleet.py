"""A fleet on this machine: an embedded Valkey (unless REDIS_URL), a coordinator with fresh random secrets and N
probe worker processes, for `sparecycles up` and for `sparecycles fleet` (your own loop against it).

`local_fleet(folder, devices, sup, log)` starts them and yields a `LocalFleet`; every child is the Supervisor's
(its own process group, logs in `folder/logs`), stopped by the caller's `sup.stop_all()`. `LocalFleet.env_lines()`
are the environment variables `sparecycles.connect`, `sparecycles train --coordinator` and examples/hf_trainer.py
read, as `export NAME=value` lines.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sparecycles.services import Supervisor, free_port, redis_url_or_embedded, wait_ready

FLEET_ENV = "fleet.env"  # in `sparecycles fleet`'s folder: the env_lines, for `source`


@dataclass(frozen=True)
class LocalFleet:
    """The services `local_fleet` started.

    url: the coordinator's base URL (http://127.0.0.1:PORT); port: its port; settings: its
    coordinator.settings.CoordinatorSettings (admin and enrollment tokens, key prefix, blob folder); redis_url and
    redis_desc: its Redis and how it came (embedded Valkey or REDIS_URL); env: the coordinator's environment (also a
    trainer's); worker_env: the workers' (no admin token, no Redis URL); metrics_ports: one per worker.
    """

    url: str
    port: int
    settings: object
    redis_url: str
    redis_desc: str
    env: dict[str, str]
    worker_env: dict[str, str]
    metrics_ports: tuple[int, ...]

    def env_lines(self) -> list[str]:
        """`export NAME=value` for the coordinator URL and the admin credentials a trainer reads (fleet.attach.
        FleetSettings), the key prefix and the blob folder (this machine: shards are written there, not uploaded),
        and the enrollment token another `sparecycles worker` joins with (one beside a serving engine, say)."""
        values = {"SPARECYCLES_COORDINATOR_URL": self.url, "SPARECYCLES_ADMIN_TOKEN": self.env["SPARECYCLES_ADMIN_TOKEN"],
                  "SPARECYCLES_REDIS_URL": self.redis_url, "SPARECYCLES_KEY_PREFIX": self.env["SPARECYCLES_KEY_PREFIX"],
                  "SPARECYCLES_BLOB_DIR": self.env["SPARECYCLES_BLOB_DIR"],
                  "SPARECYCLES_ENROLLMENT_TOKEN": self.env["SPARECYCLES_ENROLLMENT_TOKEN"]}
        return [f"export {k}={v}" for k, v in values.items()]


def _fleet_env(settings, redis_url: str, redis_desc: str, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of the coordinator (Redis URL, admin and enrollment tokens, blob folder, key prefix; its
    own broker user per worker with our embedded Valkey) and of the workers (the same less the Redis URL and the
    admin token: their broker URL comes from registration). `settings`: coordinator.settings.CoordinatorSettings."""
    admin = settings.admin_token.get_secret_value()
    enroll = settings.enrollment_token.get_secret_value()
    env = {**os.environ, "SPARECYCLES_REDIS_URL": redis_url, "SPARECYCLES_ADMIN_TOKEN": admin,
           "SPARECYCLES_ENROLLMENT_TOKEN": enroll, "SPARECYCLES_BLOB_DIR": str(out / "blobs"),
           "SPARECYCLES_KEY_PREFIX": settings.key_prefix, "PYTHONUNBUFFERED": "1"}
    if redis_desc.startswith("embedded"):  # our own Valkey: each worker gets its own broker user
        env["SPARECYCLES_BROKER_ACL"] = "1"
    # Workers get the enrollment token only: their broker URL comes from registration.
    worker_env = {k: v for k, v in env.items()
                  if k not in ("SPARECYCLES_REDIS_URL", "REDIS_URL", "SPARECYCLES_ADMIN_TOKEN")}
    return env, worker_env


def _start_workers(sup: Supervisor, py: list[str], base: str, devices: tuple[str, ...], metrics_ports: list[int],
                   worker_env: dict[str, str], worker_args: tuple[str, ...] = ()) -> None:
    """Start one probe worker process per device (`worker-<i>`, named `local-<i>`) against the coordinator at
    `base`, each serving its metrics on its port of `metrics_ports`, with `worker_args` (`sparecycles worker`
    options, e.g. `up --serving`'s --serving-metrics) after its own."""
    for i, dev in enumerate(devices):
        # The token travels in the environment (SPARECYCLES_ENROLLMENT_TOKEN), never in argv (ps).
        # CPU workers take one thread each (two share the cores with the trainer); GPU workers the defaults.
        extra = ["--threads", "1"] if dev == "cpu" else []
        # zocurv-line probes along theta_v - theta_{v-1}: a worker that runs behind still holds both versions
        # of an older round while the next two arrive, instead of reloading them from the blob store per task
        # (measured on H200: 4-5 s per task of 4 seeds with the default 2, GPU idle).
        extra += ["--keep-versions", "4"]
        sup.start(f"worker-{i}", py + ["worker", "--coordinator", base, "--name", f"local-{i}",
                                       "--device", dev, "--metrics-port", str(metrics_ports[i]), *extra,
                                       *worker_args],
                  worker_env)


@contextlib.contextmanager
def local_fleet(out: Path, devices: tuple[str, ...], sup: Supervisor, log: Callable[[str], None],
                key_prefix: str = "up", worker_args: tuple[str, ...] = ()) -> Iterator[LocalFleet]:
    """Start Valkey (unless REDIS_URL; its files in `out/valkey`), the coordinator (blobs in `out/blobs`, key prefix
    `key_prefix` + 8 random hex digits) and one probe worker per entry of `devices` (a torch device each; each with
    the `sparecycles worker` options `worker_args`); yield
    them once the coordinator answers /readyz (the workers may still be registering: fleet.attach.wait_for_workers).
    Raises RuntimeError when a service fails to start (naming its log). The caller stops them (`sup.stop_all()`)."""
    from coordinator.settings import generate_dev_settings

    with redis_url_or_embedded(out / "valkey", sup) as (redis_url, redis_desc):
        settings = generate_dev_settings(redis_url=redis_url, blob_dir=out / "blobs",
                                         key_prefix=f"{key_prefix}{secrets.token_hex(4)}")
        env, worker_env = _fleet_env(settings, redis_url, redis_desc, out)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        py = [sys.executable, "-m", "sparecycles.cli"]
        sup.start("coordinator", py + ["coordinator", "--port", str(port), "--log-level", "warning"], env)
        wait_ready(f"{base}/readyz", sup)
        log(f"coordinator {base}; logs in {sup.log_dir}")
        metrics_ports = [free_port() for _ in devices]
        _start_workers(sup, py, base, devices, metrics_ports, worker_env, worker_args)
        log(f"probe workers on {', '.join(devices)}; forward at the published float32 weights")
        yield LocalFleet(base, port, settings, redis_url, redis_desc, env, worker_env, tuple(metrics_ports))
