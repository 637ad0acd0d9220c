"""Coordinator settings from the environment (prefix `SPARECYCLES_`; `REDIS_URL` also accepted).

Secrets are refused when empty, short (< 16 characters) or a well-known default such as "changethis",
unless `dev_mode` is set explicitly. The embedded `sparecycles up` uses `generate_dev_settings()`,
which draws fresh random secrets instead.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

WEAK_SECRETS = frozenset(
    {"changethis", "changeme", "change-me", "secret", "password", "admin", "token", "default", "test", "dev"}
)
MIN_SECRET_LEN = 16


def _default_blob_dir() -> Path:
    """`$SPARECYCLES_CACHE/blobs` or `~/.cache/sparecycles/blobs` (same root as trainer.paths.cache_dir)."""
    root = os.environ.get("SPARECYCLES_CACHE") or str(Path.home() / ".cache" / "sparecycles")
    return Path(root) / "blobs"


class CoordinatorSettings(BaseSettings):
    """Coordinator configuration. Durations are seconds; sizes are bytes.

    Raises `pydantic.ValidationError` (a ValueError) on weak secrets outside dev mode, or when the admin
    and enrollment tokens are equal (an enrolled worker must not become admin).
    """

    model_config = SettingsConfigDict(env_prefix="SPARECYCLES_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("SPARECYCLES_REDIS_URL", "REDIS_URL"),
    )
    broker_url: str | None = None  # URL workers use for Celery; defaults to redis_url
    # One Redis ACL user per worker on the broker, limited to the Celery keys (coordinator.broker_acl);
    # off, every worker receives the broker URL itself (the coordinator's credentials).
    broker_acl: bool = False
    key_prefix: str = Field(default="sc", pattern=r"^[A-Za-z0-9_-]{1,32}$")
    queue_prefix: str = Field(default="sparecycles.probe", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    admin_token: SecretStr = SecretStr("")
    enrollment_token: SecretStr = SecretStr("")
    dev_mode: bool = False
    blob_dir: Path = Field(default_factory=_default_blob_dir)
    max_blob_bytes: int = Field(default=8 << 30, gt=0)
    lease_seconds: float = Field(default=30.0, gt=0)
    heartbeat_interval_s: float = Field(default=10.0, gt=0)
    reaper_interval_s: float = Field(default=1.0, gt=0)
    visibility_timeout_s: int = Field(default=3600, gt=0)
    # Re-sends per (seed, replica). Celery cannot address "any worker but X", so a spot-check replica can
    # land on the worker that evaluated the other replica several times before another takes it; re-sends
    # cost no evaluation, so the bound is generous.
    max_redispatch: int = Field(default=20, ge=0)
    # Round deadlines (coordinator.deadlines): a quiet round's outstanding seeds are re-issued after
    # max(min_s, factor x quantile of the run's progress gaps) seconds, initial_s before any gap is known,
    # at most `speculate_max` times per round.
    speculate_initial_s: float = Field(default=30.0, gt=0)
    speculate_min_s: float = Field(default=1.0, gt=0)
    speculate_factor: float = Field(default=3.0, ge=1.0)
    speculate_quantile: float = Field(default=0.9, gt=0, le=1)
    speculate_max: int = Field(default=3, ge=0)
    # Registration: workers per enrollment token (lost ones count until they expire), registrations per
    # minute per enrollment token, and how many lease periods a lost worker is kept before it is deleted.
    max_workers_per_enrollment: int = Field(default=1024, gt=0)
    registrations_per_minute: int = Field(default=120, gt=0)
    lost_expiry_leases: int = Field(default=10, gt=0)
    # Request body limits (bytes), enforced before the body is read (declared Content-Length) and while
    # it streams; see api.limits. Results: a full ResultBatch (1024 results) is ~400 KiB. Admin JSON: a
    # round of 65,536 seeds is ~1.4 MB. Everything else (registration, heartbeat, drain, attest) is tiny.
    max_body_bytes: int = Field(default=64 << 10, gt=0)
    max_results_body_bytes: int = Field(default=1 << 20, gt=0)
    max_admin_body_bytes: int = Field(default=8 << 20, gt=0)

    @model_validator(mode="after")
    def _check_secrets(self) -> CoordinatorSettings:
        if self.heartbeat_interval_s >= self.lease_seconds:
            raise ValueError("heartbeat_interval_s must be shorter than lease_seconds")
        if self.dev_mode:
            return self
        for name in ("admin_token", "enrollment_token"):
            value = getattr(self, name).get_secret_value()
            if len(value) < MIN_SECRET_LEN or value.lower() in WEAK_SECRETS:
                raise ValueError(
                    f"{name} is empty, shorter than {MIN_SECRET_LEN} characters or a default; set "
                    f"SPARECYCLES_{name.upper()} to a random value (python -c 'import secrets; "
                    "print(secrets.token_urlsafe(32))') or set SPARECYCLES_DEV_MODE=1 for local experiments"
                )
        if self.admin_token.get_secret_value() == self.enrollment_token.get_secret_value():
            raise ValueError("admin_token and enrollment_token must differ")
        return self

    @property
    def worker_broker_url(self) -> str:
        """The broker URL handed to workers (`broker_url`, else `redis_url`)."""
        return self.broker_url or self.redis_url


def generate_dev_settings(**overrides: Any) -> CoordinatorSettings:
    """Settings with fresh random 256-bit admin and enrollment tokens (for the embedded `sparecycles up`).

    `overrides` are passed to `CoordinatorSettings` (e.g. `redis_url=...`, `blob_dir=...`).
    """
    values: dict[str, Any] = {
        "admin_token": SecretStr(secrets.token_urlsafe(32)),
        "enrollment_token": SecretStr(secrets.token_urlsafe(32)),
    }
    values.update(overrides)
    return CoordinatorSettings(**values)
