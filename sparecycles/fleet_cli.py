"""`sparecycles fleet`: a fleet on this machine for your own loop, up until stopped.

Starts an embedded Valkey (unless REDIS_URL), a coordinator and N probe workers (sparecycles.local_fleet), waits for
the workers, prints the environment that `sparecycles.connect`, `sparecycles train --coordinator` and
examples/hf_trainer.py read as `export` lines on stdout (also written to FOLDER/fleet.env, readable by this user
only, for `source`), then stays up until Ctrl-C or SIGTERM, when it stops every process it started, removes the
file and exits 128 + the signal (130 after Ctrl-C, 143 after SIGTERM), as `train` and `up` do. A service that dies
ends it with exit status 1, naming its log.

Checked before anything starts (exit 2, one line, nothing written): the devices (fleet.devices.place_here, as `up`
checks them), a folder that is not a folder, and a folder another `sparecycles fleet` holds (an exclusive lock on
FOLDER/fleet.lock for the fleet's whole life: a second fleet there would overwrite the first's fleet.env and share
its Valkey files; the kernel drops the lock when the holder dies, so a killed fleet never blocks the next).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.devices import check_worker_count
from trainer.cli_settings import with_settings

LOCK = "fleet.lock"


def _refuse(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


@contextmanager
def _held(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder`/fleet.lock (made with the folder) while the block runs.

    Raises typer.Exit(2) (after one line naming the holder's pid) when another process holds it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise _refuse(f"a fleet already runs in {folder} (pid {holder}); stop it, or pass another --folder") \
                from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class FleetOptions(BaseModel):
    """`sparecycles fleet`'s options, generated into the command (trainer.cli_settings.with_settings). Raises
    pydantic.ValidationError for a worker count outside 1..64, an empty device list, or --workers given beside
    --worker-devices with another count (as `up`'s UpOptions)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(2, ge=1, le=64, description="local probe worker processes")
    folder: Path = Field(Path("runs/fleet"), description="its folder: logs/, the coordinator's blobs/, Valkey's "
                         "files and fleet.env (the environment lines)")
    worker_devices: str | None = Field(None, min_length=1, description="one probe worker per listed device, e.g. "
                                       "cuda:0,cuda:1 (replaces --workers). Default: CPU workers")

    @model_validator(mode="after")
    def _one_worker_count(self) -> FleetOptions:
        check_worker_count(self.workers if "workers" in self.model_fields_set else None, self.worker_devices)
        return self


@with_settings(model=FleetOptions, param="given", section="Options (FleetOptions)")
def fleet(given: dict[str, Any]) -> None:
    """Start a fleet on this machine for your own loop (embedded Valkey, a coordinator, N probe workers); print the
    environment lines your loop reads; stay up until Ctrl-C.

    In another shell: `source runs/fleet/fleet.env`, then `sparecycles train --coordinator
    "$SPARECYCLES_COORDINATOR_URL" ...`, `python examples/hf_trainer.py --coordinator "$SPARECYCLES_COORDINATOR_URL"`
    or `sparecycles.connect(os.environ["SPARECYCLES_COORDINATOR_URL"])` in your own loop.
    """
    try:
        opts = FleetOptions(**given)
    except ValidationError as exc:
        from trainer.preflight import explain

        raise typer.BadParameter(explain(exc, FleetOptions)) from None
    _run(opts)


def _run(opts: FleetOptions) -> None:
    """The fleet of `opts`, up until stopped (module docstring)."""
    from fleet.attach import FleetError, wait_for_workers
    from fleet.devices import place_here
    from sparecycles.local_fleet import FLEET_ENV, local_fleet
    from sparecycles.services import Supervisor
    from trainer.console import stop_signals, stop_status

    try:
        devices = place_here(worker_devices=opts.worker_devices, workers=opts.workers).workers
    except ValueError as exc:
        raise _refuse(str(exc)) from None
    out = opts.folder.resolve()
    if out.exists() and not out.is_dir():
        raise _refuse(f"--folder {opts.folder}: not a folder")
    os.environ["SPARECYCLES_UP_RUN"] = str(out)  # every child inherits it: an orphan is findable, as `up`'s are
    env_file = out / FLEET_ENV
    sup = Supervisor(out / "logs")
    stopped = False
    with _held(out), stop_signals():
        try:
            with local_fleet(out, devices, sup, lambda m: typer.echo(m, err=True), key_prefix="fleet") as local:
                wait_for_workers(local.url, local.env["SPARECYCLES_ADMIN_TOKEN"], len(devices), 120.0,
                                 check=sup.check)
                lines = local.env_lines()
                out.mkdir(parents=True, exist_ok=True)
                env_file.touch(mode=0o600)
                env_file.write_text("\n".join(lines) + "\n")
                typer.echo("\n".join(lines))
                typer.echo(f"fleet ready: {len(devices)} worker(s) at {local.url}; in another shell: source {env_file}"
                           " (Ctrl-C stops every process started here)", err=True)
                while True:
                    sup.check()
                    time.sleep(0.5)
        except KeyboardInterrupt:
            typer.echo("stopping the fleet", err=True)
            stopped = True
        except (RuntimeError, FleetError) as exc:  # a service died or never became ready
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from exc
        finally:
            sup.stop_all()
            env_file.unlink(missing_ok=True)
    if stopped:  # a clean stop by Ctrl-C or SIGTERM: 128 + the signal, as `train` and `up` end
        raise typer.Exit(stop_status())
