"""Shared pieces of the API routers: path parameter types, role dependencies and accessors of the
app's state (store, intake, metrics, settings), so each router module stays free of construction."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from api.auth import require
from coordinator.intake import Intake
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import Store

RunP = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
RoundP = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")]
WorkerP = Annotated[str, Path(pattern=r"^w-[0-9a-f]{16}$")]
ShaP = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]
VersionP = Annotated[int, Path(ge=0, lt=2**53)]

Admin = Depends(require("admin"))
AdminOrSelf = Depends(require("admin", "worker", self_worker=True))
Reader = Depends(require("admin", "worker"))
WorkerOnly = Depends(require("worker"))
SelfWorker = Depends(require("worker", self_worker=True))
Enroll = Depends(require("enroll"))


def _store(request: Request) -> Store:
    return request.app.state.store


def _intake(request: Request) -> Intake:
    return request.app.state.intake


def _metrics(request: Request) -> CoordinatorMetrics:
    return request.app.state.metrics


StoreD = Annotated[Store, Depends(_store)]
IntakeD = Annotated[Intake, Depends(_intake)]
MetricsD = Annotated[CoordinatorMetrics, Depends(_metrics)]
