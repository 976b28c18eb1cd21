"""The live picture: nodes and jobs as the sensor sees them now."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from supervisor.api.deps import Reader
from supervisor.api.node_status import NodeStatus
from supervisor.api.parts import BudgetsDep, Picture, Remedies, SettingsDep, SupervisorDep
from supervisor.api.schemas import JobOut, NodeOut
from supervisor.config_parts import SensingSettings
from supervisor.controller.budget import Budgets
from supervisor.domain import NodeState, NodeView
from supervisor.job_state import job_state
from supervisor.remedies import RemediesInFlight
from supervisor.sensor import Sensor

router = APIRouter(prefix="/api/v1", tags=["cluster"], dependencies=[Reader])


@router.get("/nodes", response_model=list[NodeOut], summary="All nodes")
async def list_nodes(
    supervisor: SupervisorDep,
    sensor: Picture,
    settings: SettingsDep,
    state: Annotated[
        NodeState | None, Query(description="As its host monitor reported it.")
    ] = None,
    status: Annotated[
        list[NodeStatus] | None,
        Query(description="What the node is now (lost, failed, draining, ...); repeatable."),
    ] = None,
    job: str | None = None,
    alive: bool | None = None,
) -> list[NodeOut]:
    out = []
    for name in sensor.node_names():
        view = sensor.node_view(name)
        assert view is not None
        if state is not None and view.state is not state:
            continue
        if job is not None and view.job != job:
            continue
        if alive is not None and view.alive is not alive:
            continue
        node = node_out(sensor, settings, supervisor.dry_run, view)
        if status and node.status not in status:
            continue
        out.append(node)
    return out


@router.get("/nodes/{name}", response_model=NodeOut, summary="One node")
async def get_node(
    supervisor: SupervisorDep, sensor: Picture, settings: SettingsDep, name: str
) -> NodeOut:
    view = sensor.node_view(name)
    if view is None:
        raise HTTPException(404, f"node {name!r} not found")
    return node_out(sensor, settings, supervisor.dry_run, view)


def node_out(sensor: Sensor, settings: SensingSettings, dry_run: bool, view: NodeView) -> NodeOut:
    return NodeOut.of(
        view,
        sensor.heartbeat_age_s(view.name),
        timeout_s=settings.heartbeat_timeout_s,
        dry_run=dry_run,
        flapping_clears_in_s=sensor.flapping_clears_in_s(view.name),
    )


@router.get("/jobs", response_model=list[JobOut], summary="All jobs")
async def list_jobs(sensor: Picture, remedies: Remedies, budgets: BudgetsDep) -> list[JobOut]:
    out = []
    for name in sensor.job_names():
        out.append(job_out(sensor, remedies, budgets, name))
    return out


@router.get("/jobs/{name}", response_model=JobOut, summary="One job")
async def get_job(sensor: Picture, remedies: Remedies, budgets: BudgetsDep, name: str) -> JobOut:
    if sensor.job_view(name) is None:
        raise HTTPException(404, f"job {name!r} not found")
    return job_out(sensor, remedies, budgets, name)


def job_out(sensor: Sensor, remedies: RemediesInFlight, budgets: Budgets, name: str) -> JobOut:
    view = sensor.job_view(name)
    assert view is not None
    nodes = {n: v for n in view.nodes if (v := sensor.node_view(n)) is not None}
    budgets.observe(name, nodes, {name: view})  # progress since its last remedy, if any
    state = job_state(sensor, remedies, budgets, name)
    return JobOut.of(
        view,
        sensor.hang_timeout_s(name),
        state,
        given_up_reason=budgets.given_up(name),
        no_progress_restarts=budgets.counts().get(name, 0),
    )
