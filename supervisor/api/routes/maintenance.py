"""Maintenance windows: a node taken out of service for a stated time, its job moved off
it first (supervisor.schedules.maintenance carries the steps out)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Path, Response, status

from resiliency_protocol.errors import ErrorOut
from supervisor.api.deps import Operator, Reader
from supervisor.api.maintenance_schemas import MaintenanceIn, MaintenanceOut
from supervisor.api.parts import Known, SchedulerDep, SupervisorDep
from supervisor.runtime import Supervisor
from supervisor.schedules import Scheduler
from supervisor.schedules.maintenance import PREFIX, RUN_WINDOW, Window, end_steps

router = APIRouter(prefix="/api/v1/maintenance", tags=["maintenance"])

WindowId = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$", description="The window's id.")]


def _scheduler(scheduler: Scheduler | None) -> Scheduler:
    if scheduler is None:
        raise HTTPException(503, "the scheduler is not running (this replica is not acting)")
    return scheduler


async def _windows(supervisor: Supervisor, scheduler: Scheduler) -> list[MaintenanceOut]:
    jobs = await asyncio.to_thread(scheduler.jobs, PREFIX)
    job_of = supervisor.node_job
    out = [MaintenanceOut.of_job(dict(j.kwargs), j.next_run_time, job_of) for j in jobs]
    return sorted(out, key=lambda w: (w.start, w.id))


@router.post(
    "",
    response_model=MaintenanceOut,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Operator],
    summary="Schedule a maintenance window on a node",
    responses={
        200: {"model": MaintenanceOut, "description": "Same Idempotency-Key seen before."},
        404: {"description": "No such node; `message` names it.", "model": ErrorOut},
        409: {"description": "Idempotency-Key already used for another window.", "model": ErrorOut},
    },
)
async def create_window(
    supervisor: SupervisorDep,
    acting: SchedulerDep,
    known: Known,
    body: MaintenanceIn,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> MaintenanceOut:
    scheduler = _scheduler(acting)
    if not known.has_node(body.node):
        raise HTTPException(404, f"node {body.node!r} not found")
    window_id = None
    if idempotency_key is not None:
        window_id = hashlib.sha256(idempotency_key.encode()).hexdigest()[:12]
        seen = await asyncio.to_thread(scheduler.get, PREFIX + window_id)
        if seen is not None:
            same = Window.of(dict(seen.kwargs))
            if (same.node, same.start, same.end, same.reason) != (
                body.node,
                body.start,
                body.end,
                body.reason,
            ):
                raise HTTPException(409, "Idempotency-Key: already used for another window")
            response.status_code = status.HTTP_200_OK
            return MaintenanceOut.of(same, seen.next_run_time, supervisor.node_job(same.node))
    window = body.window(window_id)
    job = await asyncio.to_thread(
        scheduler.add,
        window.job_id,
        RUN_WINDOW,
        window.trigger(),
        window.kwargs(),
        always_run=True,
    )
    return MaintenanceOut.of(window, job.next_run_time, supervisor.node_job(window.node))


@router.get(
    "",
    response_model=list[MaintenanceOut],
    dependencies=[Reader],
    summary="Maintenance windows to come and open, by start",
)
async def list_windows(supervisor: SupervisorDep, acting: SchedulerDep) -> list[MaintenanceOut]:
    return await _windows(supervisor, _scheduler(acting))


@router.get(
    "/{window_id}", response_model=MaintenanceOut, dependencies=[Reader], summary="A window"
)
async def get_window(
    supervisor: SupervisorDep, acting: SchedulerDep, window_id: WindowId
) -> MaintenanceOut:
    job = await asyncio.to_thread(_scheduler(acting).get, PREFIX + window_id)
    if job is None:
        raise HTTPException(404, f"maintenance window {window_id} not found")
    return MaintenanceOut.of_job(dict(job.kwargs), job.next_run_time, supervisor.node_job)


@router.delete(
    "/{window_id}",
    response_model=MaintenanceOut,
    dependencies=[Operator],
    summary="Cancel a window; an open one ends now (the node is uncordoned)",
)
async def delete_window(
    supervisor: SupervisorDep, acting: SchedulerDep, window_id: WindowId
) -> MaintenanceOut:
    scheduler = _scheduler(acting)
    job = await asyncio.to_thread(scheduler.get, PREFIX + window_id)
    if job is None:
        raise HTTPException(404, f"maintenance window {window_id} not found")
    window = MaintenanceOut.of_job(dict(job.kwargs), job.next_run_time, supervisor.node_job)
    await asyncio.to_thread(scheduler.remove, PREFIX + window_id)
    if window.state == "open":
        await supervisor.request_actions(end_steps(Window.of(dict(job.kwargs))), "maintenance")
    return window
