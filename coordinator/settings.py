"""Coordinator settings from the environment (prefix `SPARECYCLES_`; `REDIS_URL` also accepted).

Secrets are refused when empty, short (< 16 characters), a well-known default such as "changethis" or a
placeholder this repository ships (`docker/.env.example`'s "replace-with-a-long-random-string"), and the admin
and enrollment tokens must differ, unless `dev_mode` is set explicitly (SPARECYCLES_DEV_MODE=1). A password in
the Redis URL is refused when it is such a placeholder. Every refusal names the variable. `secret_problem` and
`check_secrets` are the one rule; the worker (`sparecycles worker`) and the trainer (`fleet.attach.FleetSettings`)
apply it to the secrets they read. The embedded `sparecycles up` uses `generate_dev_settings()`, which draws fresh
random secrets instead. `settings_problems` says what a settings class refused, by environment variable.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

WEAK_SECRETS = frozenset(
    {"changethis", "changeme", "change-me", "secret", "password", "admin", "token", "default", "test", "dev"}
)
# Words of placeholders (the repository's own, docker/.env.example, and the usual ones). Seven letters or more:
# a random 43-character token_urlsafe contains one of them with probability ~1e-9.
PLACEHOLDER_WORDS = ("replace-with", "replace_with", "changethis", "changeme", "change-me", "placeholder", "example",
                     "your-token", "your-secret", "your-password")
MIN_SECRET_LEN = 16
NEW_SECRET_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def secret_problem(value: str) -> str | None:
    """Why `value` cannot serve as a secret ("is empty", "is shorter than 16 characters", "is a placeholder ...");
    None when it can. Case-insensitive for the well-known defaults and placeholder words."""
    low = value.lower()
    if not value:
        return "is empty"
    if low in WEAK_SECRETS:
        return f"is the well-known default {value!r}"
    word = next((w for w in PLACEHOLDER_WORDS if w in low), None)
    if word is not None:
        return f"is a placeholder (contains {word!r}, as docker/.env.example's values do)"
    if len(value) < MIN_SECRET_LEN:
        return f"is shorter than {MIN_SECRET_LEN} characters"
    return None


def url_password_problem(url: str) -> str | None:
    """Why the password in `url` (redis://:PASSWORD@host...) is refused: a placeholder or well-known default.
    None without a password or for any other password (an external Redis may have a short one)."""
    try:
        password = urlsplit(url).password
    except ValueError:  # a malformed URL is the Redis client's error to report
        return None
    if password is None:
        return None
    problem = secret_problem(password)
    if problem is None or problem.startswith("is shorter"):
        return None
    return f"has a password that {problem} (docker/compose.yml builds it from SPARECYCLES_REDIS_PASSWORD)"


def check_secrets(secrets_by_variable: dict[str, str], urls_by_variable: dict[str, str] | None = None) -> None:
    """Raise ValueError naming every variable whose secret `secret_problem` refuses, every URL whose password
    `url_password_problem` refuses, and equal secrets (an enrolled worker must never become admin)."""
    problems = [f"{var} {why}" for var, value in secrets_by_variable.items() if (why := secret_problem(value))]
    problems += [f"{var} {why}" for var, url in (urls_by_variable or {}).items() if (why := url_password_problem(url))]
    values = [v for v in secrets_by_variable.values() if v]
    if len(set(values)) < len(values):
        problems.append(f"{' and '.join(secrets_by_variable)} are equal (they must differ)")
    if problems:
        raise ValueError("; ".join(problems) + f". Set each to a fresh random value ({NEW_SECRET_HINT}), or "
                         "SPARECYCLES_DEV_MODE=1 for local experiments only")


def env_var_of(settings_cls: type[BaseSettings], field: str) -> str:
    """The environment variable a pydantic-settings field is read from: its first validation alias when it has
    one (SPARECYCLES_REDIS_URL), else the class's env prefix plus the field's name in upper case."""
    info = settings_cls.model_fields.get(field)
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    if isinstance(alias, str):
        return alias
    return f"{settings_cls.model_config.get('env_prefix', '')}{field}".upper()


def settings_problems(exc: ValidationError, settings_cls: type[BaseSettings]) -> list[str]:
    """One line per error of `exc` (a ValidationError of `settings_cls`) naming the environment variable it came
    from, e.g. "SPARECYCLES_KEY_PREFIX: String should match pattern ..." or "SPARECYCLES_ADMIN_TOKEN is missing";
    an error of the whole model (check_secrets) names its variables itself. Input values are never shown (they
    may be secrets)."""
    out = []
    for e in exc.errors(include_input=False, include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:
            out.append(msg)
        elif e["type"] == "missing":
            out.append(f"{env_var_of(settings_cls, str(e['loc'][0]))} is missing")
        else:
            out.append(f"{env_var_of(settings_cls, str(e['loc'][0]))}: {msg}")
    return out


class DevMode(BaseSettings):
    """SPARECYCLES_DEV_MODE alone, for programs that check a secret without the coordinator's settings (the
    worker's enrollment token)."""

    model_config = SettingsConfigDict(env_prefix="SPARECYCLES_", extra="ignore")
    dev_mode: bool = False


def _default_blob_dir() -> Path:
    """`$SPARECYCLES_CACHE/blobs` or `~/.cache/sparecycles/blobs` (same root as trainer.paths.cache_dir)."""
    root = os.environ.get("SPARECYCLES_CACHE") or str(Path.home() / ".cache" / "sparecycles")
    return Path(root) / "blobs"


class CoordinatorSettings(BaseSettings):
    """Coordinator configuration. Durations are seconds; sizes are bytes.

    Raises `pydantic.ValidationError` (a ValueError) outside dev mode on a token `secret_problem` refuses, a
    placeholder password in the Redis or broker URL, or equal admin and enrollment tokens (an enrolled worker
    must not become admin); the message names each variable (`check_secrets`).
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
    # An ended run's queue stays write only in the workers' broker users (a task in flight at the end can be handed
    # back) for this many visibility timeouts, then the reaper retires it (coordinator.registry). The visibility
    # timeout is the bound: a task is held (unacked) at most that long before a worker's restore sweep hands it back
    # (every <= 10 s, probe_worker.worker), so a task taken before the end comes back by then; hence at least one.
    ended_queue_retire_timeouts: int = Field(
        default=2, ge=1, le=1000,
        description="Visibility timeouts (SPARECYCLES_VISIBILITY_TIMEOUT_S) after a run's end before its queue's "
                    "write-only rule is dropped from every worker's broker user and its leftover tasks deleted",
    )
    # Shares (coordinator.share_math): a worker stays on its run while that run's virtual time (worker-seconds per
    # unit of share) is within this many seconds of the most-owed run's, so queues switch rarely; the runs' split
    # then stays within about this much (plus one task) of their shares.
    share_hysteresis_s: float = Field(default=1.0, ge=0.0, le=3600.0, allow_inf_nan=False)
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
        urls = {"SPARECYCLES_REDIS_URL (or REDIS_URL)": self.redis_url}
        if self.broker_url:
            urls["SPARECYCLES_BROKER_URL"] = self.broker_url
        check_secrets({"SPARECYCLES_ADMIN_TOKEN": self.admin_token.get_secret_value(),
                       "SPARECYCLES_ENROLLMENT_TOKEN": self.enrollment_token.get_secret_value()}, urls)
        return self

    @property
    def worker_broker_url(self) -> str:
        """The broker URL handed to workers (`broker_url`, else `redis_url`)."""
        return self.broker_url or self.redis_url

    @property
    def ended_queue_retire_s(self) -> float:
        """Seconds from a run's end until its queue's write-only broker rule is retired
        (`ended_queue_retire_timeouts` visibility timeouts)."""
        return float(self.ended_queue_retire_timeouts * self.visibility_timeout_s)


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
