"""Fault injection: proves the whole loop works. Off unless enable_fault_injection."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, status

from resiliency_protocol.faults import FaultKind
from supervisor.api.deps import FaultInjection, Operator
from supervisor.api.drill_schemas import DrillIn
from supervisor.api.parts import FaultLog, Picture, SupervisorDep
from supervisor.api.routes.common import RecordId
from supervisor.api.schemas import FaultIn, FaultOut
from supervisor.errors import FaultNotSupported, UnknownTarget
from supervisor.fault_injection import FaultRequest

router = APIRouter(
    prefix="/api/v1/faults", tags=["faults"], dependencies=[Operator, FaultInjection]
)


@router.post(
    "", response_model=FaultOut, status_code=status.HTTP_201_CREATED, summary="Inject a fault"
)
async def inject_fault(supervisor: SupervisorDep, sensor: Picture, body: FaultIn) -> FaultOut:
    job = body.target_job()
    if body.node is not None:
        view = sensor.node_view(body.node)
        if view is None:
            raise HTTPException(404, f"node {body.node!r} not found")
        job = view.job
    request = FaultRequest(
        kind=FaultKind(body.kind) if body.kind is not None else None,
        node=body.node,
        job=job,
        params=body.params(),
        schedule=body.schedule_of(),
        drill=body.schedule.drill() if isinstance(body.schedule, DrillIn) else None,
    )
    try:
        fault, events = await supervisor.inject_fault(request)
    except UnknownTarget as exc:
        raise HTTPException(404, str(exc)) from None
    except FaultNotSupported as exc:
        raise HTTPException(422, str(exc)) from None
    return FaultOut.of(fault, [e.id for e in events if e.id is not None])


@router.get("", response_model=list[FaultOut], summary="Faults injected, newest first")
async def list_faults(log: FaultLog, active: bool | None = None) -> list[FaultOut]:
    faults = await asyncio.to_thread(log.list_faults, active)
    return [FaultOut.of(f) for f in faults]


@router.get("/{fault_id}", response_model=FaultOut, summary="A fault and what it caused")
async def get_fault(log: FaultLog, fault_id: RecordId) -> FaultOut:
    fault = await asyncio.to_thread(log.get_fault, fault_id)
    if fault is None:
        raise HTTPException(404, f"fault {fault_id} not found")
    events, actions = await asyncio.to_thread(log.linked_to_fault, fault_id)
    return FaultOut.of(fault, [e.id for e in events if e.id is not None], [a.id for a in actions])


@router.delete("/{fault_id}", response_model=FaultOut, summary="End a fault")
async def end_fault(supervisor: SupervisorDep, fault_id: RecordId) -> FaultOut:
    fault = await supervisor.end_fault(fault_id)
    if fault is None:
        raise HTTPException(404, f"fault {fault_id} not found")
    return FaultOut.of(fault)
