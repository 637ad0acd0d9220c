"""Errors of the coordinator's state layer; the API maps them to HTTP statuses (404, 409, 422, 429)."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of store errors; `reason` is a short metric label."""

    reason = "error"


class NotFound(CoordinatorError, LookupError):
    """The named run, version, round, worker or blob does not exist."""

    reason = "not_found"


class Conflict(CoordinatorError):
    """The request contradicts existing state (id reused with other content, non-linear ledger...)."""

    reason = "conflict"


class Invalid(CoordinatorError, ValueError):
    """The request is well-formed but refers to something unusable (missing blob, wrong size...)."""

    reason = "invalid"


class TooMany(CoordinatorError):
    """A rate or a cap is exceeded (HTTP 429); `retry_after` is seconds, `reason` the metric label."""

    reason = "too_many"

    def __init__(self, message: str, retry_after: int = 1, reason: str = "too_many") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class Unavailable(CoordinatorError, ConnectionError):
    """Redis (or the coordinator) stayed unreachable past a bounded retry budget; a ConnectionError, so
    callers that checkpoint on connection loss (trainer.train) catch it without importing this module."""

    reason = "unavailable"
