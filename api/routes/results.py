"""`POST /v1/runs/{run}/results`: intake of one task's results (the hot path)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api.auth import require
from api.deps import RunP
from wire.round_messages import IntakeReply, ResultBatch, ResultEnvelope, parse_result

router = APIRouter()
_worker_only = require("worker")


def json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` documenting a JSON request body of `model` for a route that parses it itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


@router.post("/v1/runs/{run}/results", response_model=IntakeReply, openapi_extra=json_body(ResultBatch))
async def submit_results(run: RunP, request: Request) -> Response:
    """Intake of one task's results (a `ResultBatch`); the reply lists each result's outcome in order."""
    # The body is parsed and validated by pydantic-core straight from bytes, not through FastAPI's
    # body machinery (json.loads, then a Python-side validation): the same strict model, the same
    # 422, for less CPU on the path every result takes. Authentication still comes first.
    # A batch with a bad entry is then re-read entry by entry: only the envelope (JSON, 1..1024 entries)
    # can refuse the whole batch (422); each bad entry gets its own outcome, `malformed` or `non_finite`.
    who = await _worker_only(request)
    raw = await request.body()
    state = request.app.state
    try:
        body = ResultBatch.model_validate_json(raw)
    except ValidationError:
        try:
            envelope = ResultEnvelope.model_validate_json(raw)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None
        parsed = [parse_result(entry) for entry in envelope.results]
        outcomes = await state.intake.submit_entries_async(state.aredis(), who.worker_id, run, parsed)
        task_s = envelope.task_s
    else:
        outcomes = await state.intake.submit_async(state.aredis(), who.worker_id, run, list(body.results))
        task_s = body.task_s
    if task_s is not None and await state.store.shares.add_time_async(state.aredis(), run, task_s) is not None:
        state.metrics.run_worker_seconds.labels(run).inc(task_s)  # the run's worker-seconds (its share's measure)
    # Serialised directly (the hot path): the outcomes are already of the IntakeReply type.
    return Response(json.dumps({"schema_version": 1, "outcomes": outcomes}), media_type="application/json")
