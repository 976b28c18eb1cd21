from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response, status

from supervisor.api.deps import Operator, Reader
from supervisor.api.parts import ActionLog, Known, SupervisorDep
from supervisor.api.routes.common import RecordId, RecordIdFilter, as_utc, check_known, page_of
from supervisor.api.schemas import ActionIn, ActionOut, Page, UtcTime
from supervisor.domain import ActionRequest, ActionStatus, ActionType
from supervisor.errors import RequestRefused, UnknownTarget
from supervisor.store import ActionFilter

router = APIRouter(prefix="/api/v1/actions", tags=["actions"])


@router.get(
    "", response_model=Page[ActionOut], dependencies=[Reader], summary="Actions, newest first"
)
async def list_actions(
    actions: ActionLog,
    known: Known,
    type: Annotated[list[ActionType] | None, Query(description="Repeat to match several.")] = None,
    status: ActionStatus | None = None,
    node: str | None = None,
    job: str | None = None,
    event_id: RecordIdFilter = None,
    since: UtcTime | None = None,
    until: UtcTime | None = None,
    dry_run: Annotated[
        bool | None,
        Query(
            description="true: only what a dry-run supervisor would have done; false: "
            "only what was done."
        ),
    ] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[ActionOut]:
    check_known(known, node=node, job=job)
    filters = ActionFilter(
        types=type or (),
        status=status,
        node=node,
        job=job,
        event_id=event_id,
        since=as_utc(since),
        until=as_utc(until),
        dry_run=dry_run,
    )
    page = await page_of(actions.list_actions, filters, cursor, limit)
    return Page[ActionOut](
        items=[ActionOut.of(a) for a in page.items], next_cursor=page.next_cursor
    )


@router.get("/{action_id}", response_model=ActionOut, dependencies=[Reader], summary="One action")
async def get_action(actions: ActionLog, action_id: RecordId) -> ActionOut:
    action = await asyncio.to_thread(actions.get_action, action_id)
    if action is None:
        raise HTTPException(404, f"action {action_id} not found")
    return ActionOut.of(action)


@router.post(
    "",
    response_model=ActionOut,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Operator],
    summary="Ask for an action by hand",
    responses={200: {"model": ActionOut, "description": "Same Idempotency-Key seen before."}},
)
async def post_action(
    supervisor: SupervisorDep,
    body: ActionIn,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=150, description="Repeat a request safely: same key, same action."),
    ] = None,
) -> ActionOut:
    request = ActionRequest(
        body.type, job=body.job, node=body.node, params=body.params, reason=body.reason
    )
    try:
        action, created = await supervisor.request_action(
            request, idempotency_key or uuid.uuid4().hex
        )
    except UnknownTarget as exc:
        raise HTTPException(404, str(exc)) from None
    except RequestRefused as exc:
        raise HTTPException(422, str(exc)) from None
    if not created:
        response.status_code = status.HTTP_200_OK
    return ActionOut.of(action)
