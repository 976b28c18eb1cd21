"""Heartbeats from host monitors: the hot path. Memory only unless something changed."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from supervisor.api.deps import Agent, SupervisorDep
from supervisor.api.schemas import HeartbeatAck
from supervisor.sensor import HostHeartbeat

router = APIRouter(prefix="/api/v1", tags=["sensor"])

_NO_EVENTS = b'{"events":[]}'


@router.post(
    "/heartbeats",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=HeartbeatAck,
    dependencies=[Agent],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/HostHeartbeat"}}
            },
        }
    },
    summary="Report a host heartbeat (its workers and GPU errors)",
)
async def post_heartbeat(request: Request, supervisor: SupervisorDep) -> Response:
    # Parsed straight from bytes by pydantic-core: the cheapest validation there is.
    try:
        heartbeat = HostHeartbeat.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        ) from None
    events = await supervisor.ingest(heartbeat)
    if not events:
        return Response(_NO_EVENTS, status.HTTP_202_ACCEPTED, media_type="application/json")
    body = HeartbeatAck(events=[e.id for e in events if e.id is not None])
    return Response(body.model_dump_json(), status.HTTP_202_ACCEPTED, media_type="application/json")
