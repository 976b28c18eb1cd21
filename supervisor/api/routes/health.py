"""Probes and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor.api.job_metrics import JobMetrics
from supervisor.api.parts import DatabasePing, MetricsDep, SupervisorDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process serves requests")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: started (the leader, under leader election) and the database answers",
    responses={
        503: {"description": "Not ready: starting, stopping, or a standby (names the leader)"}
    },
)
async def readyz(
    supervisor: SupervisorDep, ping: DatabasePing, response: Response
) -> dict[str, Any]:
    if not supervisor.ready:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return supervisor.readiness
    try:
        await asyncio.wait_for(asyncio.to_thread(ping), timeout=2)
    except Exception as exc:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return {"status": f"database unavailable: {type(exc).__name__}"}
    return {"status": "ready"}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(metrics: MetricsDep, request: Request) -> Response:
    job_metrics: JobMetrics = request.app.state.job_metrics
    await job_metrics.refresh()  # the history figures, when stale (in a thread)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
