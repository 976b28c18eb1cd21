"""POST /api/v1/jobs/{name}/reset-budget: an operator starts a job's restart budget over
(`supervisor reset-budget JOB`). The job is healed again if it fails; the reset is
recorded as a `job_budget_reset` event, committed before the answer."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from supervisor.api.deps import Operator
from supervisor.api.parts import ControllerDep, Picture, Remedies, SupervisorDep
from supervisor.api.routes.cluster import job_out
from supervisor.api.schemas import EventOut, JobOut
from supervisor.sensor import Changes

router = APIRouter(prefix="/api/v1", tags=["cluster"], dependencies=[Operator])


class BudgetReset(BaseModel):
    job: JobOut = Field(description="The job as it stands after the reset.")
    event: EventOut = Field(description="The `job_budget_reset` event that records it.")


@router.post(
    "/jobs/{name}/reset-budget",
    response_model=BudgetReset,
    summary="Start a job's restart budget over (recorded as a job_budget_reset event)",
)
async def reset_budget(
    supervisor: SupervisorDep,
    controller: ControllerDep,
    sensor: Picture,
    remedies: Remedies,
    name: str,
) -> BudgetReset:
    if sensor.job_view(name) is None:
        raise HTTPException(404, f"name: job {name!r} not found")
    event = await controller.reset_budget(name)  # kept before it is said
    (recorded,) = await supervisor.record(Changes(events=[event]))
    job = job_out(sensor, remedies, controller.budgets, name)
    return BudgetReset(job=job, event=EventOut.of(recorded))
