"""Pages of a listing and the filters of each, and the cursors the API hands out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from supervisor.domain import (
    ActionStatus,
    ActionType,
    EventType,
)
from supervisor.errors import SupervisorError
from supervisor.notices import DeliveryStatus

MAX_ID = 2**63 - 1  # BIGINT


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class EventFilter:
    types: Sequence[EventType] = ()
    node: str | None = None
    job: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class ActionFilter:
    types: Sequence[ActionType] = ()
    status: ActionStatus | None = None
    node: str | None = None
    job: str | None = None
    event_id: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    #: Only what a dry-run supervisor would have done (True), or only what was done.
    dry_run: bool | None = None


@dataclass(frozen=True, slots=True)
class DeliveryFilter:
    status: DeliveryStatus | None = None
    route: str | None = None
    kind: str | None = None
    item_id: int | None = None
    job: str | None = None


class InvalidCursor(SupervisorError, ValueError):
    """A page cursor that is not one this API handed out."""


def decode_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    try:
        value = int(cursor)
    except ValueError:
        raise InvalidCursor("cursor: not a cursor returned by this API") from None
    if not 1 <= value <= MAX_ID:
        raise InvalidCursor("cursor: not a cursor returned by this API")
    return value
