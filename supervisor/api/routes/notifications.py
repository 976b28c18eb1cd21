"""Notification deliveries: what was sent to which route, and how it went. Never the
routes' URLs or headers (secrets)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from supervisor.api.deps import Reader
from supervisor.api.parts import DeliveryLog, Known
from supervisor.api.routes.common import RecordId, RecordIdFilter, check_known, page_of
from supervisor.api.schemas import Page
from supervisor.config_parts.notification_routes import ROUTE_NAME_PATTERN
from supervisor.notices import Delivery, DeliveryStatus
from supervisor.store import DeliveryFilter

router = APIRouter(prefix="/api/v1/notifications", tags=["notifications"], dependencies=[Reader])


class NotificationOut(BaseModel):
    id: int
    route: str
    sink: str = Field(description="webhook, slack or alertmanager.")
    kind: Literal["event", "action"]
    item_id: int = Field(description="Id of the event or action notified.")
    type: str = Field(description="Its event or action type.")
    outcome: str | None = Field(description="An action's: succeeded or failed.")
    job: str | None
    node: str | None
    summary: str
    status: DeliveryStatus
    attempts: int
    last_error: str | None = Field(description="What went wrong in the last attempt.")
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = Field(description="When it was delivered or given up.")
    notice: dict[str, Any] = Field(description="What was sent, as the webhook sink sends it.")

    @classmethod
    def of(cls, d: Delivery) -> NotificationOut:
        n = d.notice
        return cls(
            id=d.id,
            route=d.route,
            sink=d.sink,
            kind=n.kind,
            item_id=n.id,
            type=n.type,
            outcome=n.outcome,
            job=n.job,
            node=n.node,
            summary=n.summary,
            status=d.status,
            attempts=d.attempts,
            last_error=d.last_error,
            created_at=d.created_at,
            updated_at=d.updated_at,
            finished_at=d.finished_at,
            notice=n.to_json(),
        )


@router.get("", response_model=Page[NotificationOut], summary="Notifications, newest first")
async def list_notifications(
    deliveries: DeliveryLog,
    known: Known,
    status: DeliveryStatus | None = None,
    # Only a route's name: anything else (a NUL, which PostgreSQL refuses) names no route.
    route: Annotated[
        str | None, Query(max_length=100, pattern=ROUTE_NAME_PATTERN, description="Route name.")
    ] = None,
    kind: Literal["event", "action"] | None = None,
    item_id: RecordIdFilter = None,
    job: str | None = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[NotificationOut]:
    check_known(known, job=job)
    filters = DeliveryFilter(status=status, route=route, kind=kind, item_id=item_id, job=job)
    page = await page_of(deliveries.list_deliveries, filters, cursor, limit)
    return Page[NotificationOut](
        items=[NotificationOut.of(d) for d in page.items], next_cursor=page.next_cursor
    )


@router.get("/{notification_id}", response_model=NotificationOut, summary="One notification")
async def get_notification(deliveries: DeliveryLog, notification_id: RecordId) -> NotificationOut:
    delivery = await asyncio.to_thread(deliveries.get_delivery, notification_id)
    if delivery is None:
        raise HTTPException(404, f"notification {notification_id} not found")
    return NotificationOut.of(delivery)
