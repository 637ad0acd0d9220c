"""Errors of the coordinator's state layer; the API maps them to HTTP statuses (404, 409, 422)."""

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
