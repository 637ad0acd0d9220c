"""The one HTTP client of the coordinator's REST API, used by probe workers and by the trainer's fleet backend.

Torch-free. Every call has a timeout (connect, read, write, pool) and bounded retries.

Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential
backoff (tenacity) up to `attempts` times; other HTTP errors are raised at once as `CoordinatorHTTPError`
carrying the status code, because repeating a refused request cannot succeed; a refusal saying the coordinator
no longer knows the caller's worker, run or round (it lost its state) is the subclass `Forgotten`.
Blobs are streamed to disk while hashed, and a blob whose sha256 differs from its name is deleted and
raised as `CorruptBlobError` (never handed to a loader).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from json import loads
from typing import Any, Self, TypeVar

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from wire.messages import (
    Attestation,
    BlobInfo,
    Heartbeat,
    HeartbeatReply,
    IntakeCounts,
    RunInfo,
    RunSpec,
    SeedLedgerEntry,
    VersionManifest,
    WorkerRegistered,
    WorkerRegistration,
)
from wire.round_messages import IntakeReply, ProbeRound, ResultBatch, RoundInfo
from wire.teacher_messages import TeacherManifest, TeacherRun

T = TypeVar("T")


class CoordinatorHTTPError(RuntimeError):
    """The coordinator answered with an HTTP error; `status` is the code, `detail` its body (truncated)."""

    def __init__(self, method: str, url: str, status: int, detail: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {detail[:300]}")
        self.status, self.detail = status, detail


# What a coordinator that lost its state (Redis restarted empty, a failover to a fresh replica, a flush) no
# longer knows, by the detail of its refusal: the API says "unknown token" (401) for a worker token whose record
# is gone and "unknown run|worker|round ..." (404, coordinator.errors.NotFound) for the rest.
_FORGOTTEN = {"unknown token": "worker", "unknown worker": "worker", "unknown run": "run", "unknown round": "round"}


class Forgotten(CoordinatorHTTPError):
    """The coordinator no longer knows the caller's worker, run or round (`what`: "worker", "run" or "round").

    Raised for HTTP 401 "unknown token" and 404 "unknown worker|run|round": what the coordinator answers once it
    lost its state or an admin deleted the record. Not transient (repeating cannot succeed): a worker re-enrolls
    (probe_worker.worker), the trainer re-creates its run (fleet.recovery). Still a CoordinatorHTTPError.
    """

    def __init__(self, method: str, url: str, status: int, detail: str, what: str) -> None:
        super().__init__(method, url, status, detail)
        self.what = what


def http_error(method: str, url: str, status: int, body: str) -> CoordinatorHTTPError:
    """The error for an HTTP error answer: `Forgotten` when it says the coordinator forgot a worker, run or
    round (401/404 with one of the details above), else `CoordinatorHTTPError`."""
    if status in (401, 404):
        try:
            detail = loads(body).get("detail")
        except (ValueError, AttributeError):
            detail = None
        if isinstance(detail, str):
            for prefix, what in _FORGOTTEN.items():
                if detail.startswith(prefix):
                    return Forgotten(method, url, status, body, what)
    return CoordinatorHTTPError(method, url, status, body)


class CorruptBlobError(ValueError):
    """A downloaded or cached blob's sha256 does not match its content address."""


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: transport errors/timeouts, HTTP 429 and 5xx."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, CoordinatorHTTPError) and (exc.status == 429 or exc.status >= 500)


UPLOAD_CHUNK_BYTES = 1 << 20


def upload_chunks(data: bytes, chunk_bytes: int = UPLOAD_CHUNK_BYTES) -> Iterator[memoryview]:
    """`data` as consecutive zero-copy views of at most `chunk_bytes` bytes (a request body for httpx).

    Raises ValueError for a non-positive `chunk_bytes`.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield view[start:start + chunk_bytes]


class CoordinatorClient:
    """Synchronous coordinator client for one identity (a worker token or the admin token).

    Worker calls (register, heartbeat, attest, post_results, blobs) and the trainer's admin calls
    (create_run, put_blob, post_version, post_ledger, post_round, round_info) share the retry policy.

    Args:
        base_url: coordinator root, e.g. "http://127.0.0.1:8000".
        token: bearer token sent as `Authorization: Bearer <token>` (None before registration).
        timeout_s: per-request timeout in seconds (connect, read, write, pool).
        attempts: total tries for a transient failure (>= 1).
        max_wait_s: cap of the exponential backoff between tries, seconds.
        outage_s: seconds a transient failure is retried even past `attempts` (0: `attempts` alone decides). A
            caller that has already reached the coordinator sets it (`outage_s` attribute) so that a restart or a
            rolling deploy, seconds with the port closed, is waited out, while a first call to a wrong address
            still fails after `attempts`.
    Raises ValueError for a non-http(s) base_url or non-positive limits.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = 30.0,
                 attempts: int = 10, max_wait_s: float = 5.0, outage_s: float = 0.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0 or attempts < 1 or max_wait_s < 0 or not 0 <= outage_s < float("inf"):
            raise ValueError("timeout_s must be > 0, attempts >= 1, max_wait_s >= 0 and outage_s finite and >= 0")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.attempts, self.max_wait_s, self.outage_s = attempts, max_wait_s, outage_s
        self.results_schema = 2  # 1 once the coordinator refused a result batch's task time (post_results)
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout_s))

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------------

    def _retrying(self, fn: Callable[[], T]) -> T:
        for attempt in Retrying(
            stop=stop_after_attempt(self.attempts) & stop_after_delay(self.outage_s),  # both spent
            wait=wait_exponential(multiplier=0.2, max=self.max_wait_s),
            retry=retry_if_exception(is_transient),
            reraise=True,
        ):
            with attempt:
                return fn()
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _headers(self, token: str | None) -> dict[str, str]:
        tok = token if token is not None else self.token
        return {"Authorization": f"Bearer {tok}"} if tok else {}

    def request(self, method: str, path: str, *, json: Any = None, token: str | None = None,
                params: dict[str, Any] | None = None, content: bytes | Callable[[], Iterable[Any]] | None = None,
                content_length: int | None = None, content_type: str = "application/octet-stream",
                accept: tuple[int, ...] = ()) -> httpx.Response:
        """One request with retries; returns the response, or raises CoordinatorHTTPError/httpx errors.

        `content` sends raw bytes (of `content_type`) instead of `json`: a `bytes`, or a callable returning a
        fresh iterable of byte chunks (memoryviews) per try, whose total `content_length` (bytes) must then be
        given. Error statuses listed in `accept` (e.g. 409 for "already exists") are returned instead of raised.
        Raises ValueError for a chunk callable without content_length.
        """
        headers = self._headers(token)
        if content is not None:
            if callable(content) and content_length is None:
                raise ValueError("a streamed body needs its content_length")
            headers["Content-Type"] = content_type
            headers["Content-Length"] = str(content_length if callable(content) else len(content))

        def once() -> httpx.Response:
            # A fresh chunk iterator per try: handing httpx one large `bytes` makes its socket writer copy the
            # unsent rest after every partial send (quadratic; 200 MiB took 4-5 s on loopback, chunks 0.5 s).
            body = None if content is None else content() if callable(content) else upload_chunks(content)
            r = self._http.request(method, path, json=json, params=params, content=body, headers=headers)
            if r.status_code >= 400 and r.status_code not in accept:
                raise http_error(method, path, r.status_code, r.text)
            return r

        return self._retrying(once)

    # ---- worker calls ------------------------------------------------------------------------------

    def register(self, reg: WorkerRegistration, enrollment_token: str) -> WorkerRegistered:
        """`POST /v1/workers` with the enrollment token; stores the returned worker token for later calls."""
        r = self.request("POST", "/v1/workers", json=reg.model_dump(mode="json"), token=enrollment_token)
        out = WorkerRegistered.model_validate_json(r.content)
        self.token = out.worker_token
        return out

    def heartbeat(self, worker_id: str, hb: Heartbeat) -> HeartbeatReply:
        """`POST /v1/workers/{id}/heartbeat`: renew the lease; the reply carries state and queues."""
        r = self.request("POST", f"/v1/workers/{worker_id}/heartbeat", json=hb.model_dump(mode="json"))
        return HeartbeatReply.model_validate_json(r.content)

    def run_info(self, run: str, newer_than: int | None = None, wait_s: float = 0.0) -> RunInfo:
        """`GET /v1/runs/{run}`; with `newer_than` and `wait_s` (seconds, <= 10, below this client's timeout) a
        long poll that answers once the run's latest version exceeds `newer_than`, or after `wait_s`."""
        params = {"newer_than": newer_than, "wait_s": wait_s} if newer_than is not None and wait_s > 0 else None
        return RunInfo.model_validate_json(self.request("GET", f"/v1/runs/{run}", params=params).content)

    def version(self, run: str, version: int) -> VersionManifest:
        """`GET /v1/runs/{run}/versions/{version}`: a version's manifest."""
        r = self.request("GET", f"/v1/runs/{run}/versions/{version}")
        return VersionManifest.model_validate_json(r.content)

    def versions(self, run: str) -> list[int]:
        """`GET /v1/runs/{run}/versions`: the run's snapshot versions, ascending."""
        return [int(v) for v in self.request("GET", f"/v1/runs/{run}/versions").json()]

    def ledger(self, run: str, since: int, limit: int) -> list[SeedLedgerEntry]:
        """`GET /v1/runs/{run}/ledger`: pure-ZO entries with version > since, ascending, at most `limit`."""
        r = self.request("GET", f"/v1/runs/{run}/ledger", params={"since": since, "limit": limit})
        return [SeedLedgerEntry.model_validate(e) for e in r.json()]

    def attest(self, run: str, att: Attestation) -> None:
        """`POST /v1/runs/{run}/attest`: prove this worker generates the run's canary direction."""
        self.request("POST", f"/v1/runs/{run}/attest", json=att.model_dump(mode="json"))

    def post_results(self, run: str, batch: ResultBatch) -> IntakeReply:
        """`POST /v1/runs/{run}/results`: report one task's results; returns the per-result outcomes. A batch with
        the task's time (schema 2) that a coordinator refuses (422: one older than shares) is sent again without it,
        and so are all later ones of this client."""
        if batch.task_s is not None and self.results_schema < 2:
            batch = ResultBatch(results=batch.results)
        try:  # serialised by pydantic: a non-finite loss travels as a JSON NaN token (httpx's json= refuses it)
            r = self.request("POST", f"/v1/runs/{run}/results", content=batch.model_dump_json().encode(),
                             content_type="application/json")
        except CoordinatorHTTPError as exc:
            if exc.status != 422 or batch.task_s is None or "task_s" not in exc.detail:
                raise
            self.results_schema = 1
            return self.post_results(run, batch)
        return IntakeReply.model_validate_json(r.content)

    # ---- trainer (admin) calls ------------------------------------------------------------------------

    def create_run(self, spec: RunSpec) -> bool:
        """`POST /v1/runs`; True if created, False if a run of that id exists already (409)."""
        return self.request("POST", "/v1/runs", json=spec.model_dump(mode="json"), accept=(409,)).status_code != 409

    def put_blob(self, sha256: str, data: bytes | Callable[[], Iterable[Any]], nbytes: int | None = None) -> BlobInfo:
        """`PUT /v1/blobs/{sha256}`: upload `data` under its content address (idempotent). `data`: bytes, or a
        callable giving a fresh iterable of chunks per try (e.g. `wire.shards.ShardPlan.chunks`) whose total is
        `nbytes` bytes. Raises CoordinatorHTTPError (e.g. 400 when the content does not hash to `sha256`)."""
        r = self.request("PUT", f"/v1/blobs/{sha256}", content=data, content_length=nbytes)
        return BlobInfo.model_validate_json(r.content)

    def has_blob(self, sha256: str) -> bool:
        """`HEAD /v1/blobs/{sha256}`: True if the coordinator's store holds the blob."""
        return self.request("HEAD", f"/v1/blobs/{sha256}", accept=(404,)).status_code != 404

    def post_version(self, manifest: VersionManifest) -> None:
        """`POST /v1/runs/{run}/versions`: register a weight snapshot whose shards are uploaded."""
        self.request("POST", f"/v1/runs/{manifest.run}/versions", json=manifest.model_dump(mode="json"))

    def post_ledger(self, entry: SeedLedgerEntry) -> None:
        """`POST /v1/runs/{run}/ledger`: register a pure-ZO version as a seed-ledger entry."""
        self.request("POST", f"/v1/runs/{entry.run}/ledger", json=entry.model_dump(mode="json"))

    def post_round(self, rnd: ProbeRound) -> RoundInfo:
        """`POST /v1/runs/{run}/rounds`: open a probe round (the coordinator dispatches its tasks)."""
        r = self.request("POST", f"/v1/runs/{rnd.run}/rounds", json=rnd.model_dump(mode="json"))
        return RoundInfo.model_validate_json(r.content)

    def intake_counts(self, run: str) -> IntakeCounts:
        """`GET /v1/runs/{run}/intake`: the run's results intake refused as stale or duplicate so far."""
        return IntakeCounts.model_validate_json(self.request("GET", f"/v1/runs/{run}/intake").content)

    def close_round(self, run: str, round_id: str) -> RoundInfo:
        """`POST /v1/runs/{run}/rounds/{round_id}/close`: withdraw a round (later results are dropped, nothing is
        re-dispatched; workers skip its queued tasks)."""
        r = self.request("POST", f"/v1/runs/{run}/rounds/{round_id}/close")
        return RoundInfo.model_validate_json(r.content)

    def end_run(self, run: str) -> dict[str, Any]:
        """`POST /v1/runs/{run}/end`: close the run's open rounds, stop workers consuming its queue, purge it."""
        return self.request("POST", f"/v1/runs/{run}/end").json()

    def register_teacher(self, body: TeacherRun) -> None:
        """`POST /v1/teachers`: register a run's teacher rounds (its files uploaded as blobs); every worker then
        consumes its queue. Raises CoordinatorHTTPError (422: a file not uploaded; 409: another teacher)."""
        self.request("POST", "/v1/teachers", json=body.model_dump(mode="json"))

    def end_teacher(self, run: str) -> None:
        """`POST /v1/teachers/{run}/end`: workers stop consuming the run's teacher queue."""
        self.request("POST", f"/v1/teachers/{run}/end")

    def teacher_manifest(self, sha256: str) -> TeacherManifest:
        """`GET /v1/teachers/{sha256}`: a registered teacher's files as blobs. Raises CoordinatorHTTPError (404)."""
        return TeacherManifest.model_validate_json(self.request("GET", f"/v1/teachers/{sha256}").content)

    def round_info(self, run: str, round_id: str) -> RoundInfo:
        """`GET /v1/runs/{run}/rounds/{round_id}`: a round's progress."""
        return RoundInfo.model_validate_json(self.request("GET", f"/v1/runs/{run}/rounds/{round_id}").content)

    def download_blob_into(self, sha256: str, out: memoryview) -> None:
        """Stream `GET /v1/blobs/{sha256}` into `out` (exactly its size in bytes, e.g. a pinned buffer's view),
        hashing as it arrives: the caller parses the very bytes that were verified, with no file in between.

        Raises CorruptBlobError if the content's sha256 or size differs (`out` then holds garbage); transient
        HTTP errors are retried.
        """

        def once() -> None:
            digest, got = hashlib.sha256(), 0
            with self._http.stream("GET", f"/v1/blobs/{sha256}", headers=self._headers(None)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise CoordinatorHTTPError("GET", f"/v1/blobs/{sha256}", r.status_code, r.text)
                for chunk in r.iter_bytes(4 << 20):
                    n = len(chunk)
                    if got + n > len(out):
                        raise CorruptBlobError(f"blob {sha256} is longer than the {len(out)} bytes expected")
                    out[got:got + n] = chunk
                    digest.update(chunk)
                    got += n
            if got != len(out) or digest.hexdigest() != sha256:
                raise CorruptBlobError(f"blob {sha256} arrived as {got} bytes with sha256 {digest.hexdigest()}")

        self._retrying(once)

    def get_blob(self, sha256: str) -> bytes:
        """Download a (small) blob into memory, verified. Raises CorruptBlobError on a hash mismatch."""

        def once() -> bytes:
            r = self._http.get(f"/v1/blobs/{sha256}", headers=self._headers(None))
            if r.status_code >= 400:
                raise CoordinatorHTTPError("GET", f"/v1/blobs/{sha256}", r.status_code, r.text)
            if hashlib.sha256(r.content).hexdigest() != sha256:
                raise CorruptBlobError(f"blob {sha256} arrived corrupt; discarded")
            return r.content

        return self._retrying(once)
