"""Helpers shared by the read routes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from fastapi import HTTPException, Path, Query

from supervisor.api.parts import KnownNames
from supervisor.store import InvalidCursor, Page

#: Ids of stored records are SQL BIGINTs: a larger one is refused with a 422 naming the
#: parameter, not passed on to the database driver (which fails with a 500).
MAX_RECORD_ID = 2**63 - 1
RecordId = Annotated[int, Path(ge=1, le=MAX_RECORD_ID)]
RecordIdFilter = Annotated[int | None, Query(ge=1, le=MAX_RECORD_ID)]

T = TypeVar("T")
F = TypeVar("F")


def check_known(known: KnownNames, *, node: str | None = None, job: str | None = None) -> None:
    """404 for a node or job the supervisor has never seen (most often a typo)."""
    if node is not None and not known.has_node(node):
        raise HTTPException(404, f"node {node!r} not found")
    if job is not None and not known.has_job(job):
        raise HTTPException(404, f"job {job!r} not found")


def as_utc(value: datetime | None) -> datetime | None:
    """Query times without a zone are taken as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def check_range(since: datetime | None, until: datetime | None) -> None:
    if since is not None and until is not None and since >= until:
        raise HTTPException(422, "since: must be earlier than until")


async def page_of(
    query: Callable[[F, str | None, int], Page[T]], filters: F, cursor: str | None, limit: int
) -> Page[T]:
    since: Any = getattr(filters, "since", None)
    until: Any = getattr(filters, "until", None)
    check_range(since, until)
    try:
        return await asyncio.to_thread(query, filters, cursor, limit)
    except InvalidCursor as exc:
        raise HTTPException(422, str(exc)) from None
