from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from supervisor.api.deps import Reader
from supervisor.api.parts import EventLog, Known
from supervisor.api.routes.common import RecordId, as_utc, check_known, page_of
from supervisor.api.schemas import EventOut, Page, UtcTime
from supervisor.domain import EventType
from supervisor.store import EventFilter

router = APIRouter(prefix="/api/v1/events", tags=["events"], dependencies=[Reader])


@router.get("", response_model=Page[EventOut], summary="Events, newest first")
async def list_events(
    events: EventLog,
    known: Known,
    type: Annotated[list[EventType] | None, Query(description="Repeat to match several.")] = None,
    node: str | None = None,
    job: str | None = None,
    since: Annotated[UtcTime | None, Query(description="Events at or after (ISO 8601).")] = None,
    until: Annotated[UtcTime | None, Query(description="Events before (ISO 8601).")] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[EventOut]:
    check_known(known, node=node, job=job)
    filters = EventFilter(
        types=type or (), node=node, job=job, since=as_utc(since), until=as_utc(until)
    )
    page = await page_of(events.list_events, filters, cursor, limit)
    return Page[EventOut](items=[EventOut.of(e) for e in page.items], next_cursor=page.next_cursor)


@router.get("/{event_id}", response_model=EventOut, summary="One event")
async def get_event(events: EventLog, event_id: RecordId) -> EventOut:
    event = await asyncio.to_thread(events.get_event, event_id)
    if event is None:
        raise HTTPException(404, f"event {event_id} not found")
    return EventOut.of(event)
