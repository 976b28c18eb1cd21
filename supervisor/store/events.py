"""Recorded events: reads, the ones not handled yet, and handling one (its actions
recorded with it, atomically)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    Event,
    utcnow,
)
from supervisor.store.base import RepositoryBase
from supervisor.store.mappers import (
    action_of,
    event_of,
)
from supervisor.store.models import (
    ActionRow,
    EventRow,
)
from supervisor.store.queries import EventFilter, Page, decode_cursor


class EventRecords(RepositoryBase):
    # --- events -----------------------------------------------------------------------

    def get_event(self, event_id: int) -> Event | None:
        with self._sessions() as session:
            row = session.get(EventRow, event_id)
            return event_of(row) if row else None

    def list_events(
        self, filters: EventFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[Event]:
        after = decode_cursor(cursor)
        query = select(EventRow).order_by(EventRow.id.desc()).limit(limit + 1)
        if filters.types:
            query = query.where(EventRow.type.in_([t.value for t in filters.types]))
        if filters.node:
            query = query.where(EventRow.node == filters.node)
        if filters.job:
            query = query.where(EventRow.job == filters.job)
        if filters.since:
            query = query.where(EventRow.time >= filters.since)
        if filters.until:
            query = query.where(EventRow.time < filters.until)
        if after is not None:
            query = query.where(EventRow.id < after)
        with self._sessions() as session:
            rows = list(session.scalars(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page([event_of(r) for r in rows], str(rows[-1].id) if more and rows else None)

    def unhandled_events(self) -> list[Event]:
        query = select(EventRow).where(EventRow.handled_at.is_(None)).order_by(EventRow.id)
        with self._sessions() as session:
            return [event_of(r) for r in session.scalars(query)]

    def handle_event(
        self,
        event_id: int,
        requests: Sequence[ActionRequest],
        *,
        policy_error: str | None = None,
    ) -> list[ActionRecord]:
        """Record the actions chosen for an event and mark it handled, atomically; with
        `policy_error`, what the policy raised instead of deciding.

        Handling the same event again returns the actions recorded the first time.
        """
        now = utcnow()
        with self._sessions.begin() as session:
            event = session.get(EventRow, event_id, with_for_update=True)
            if event is None:
                raise KeyError(event_id)
            if event.handled_at is not None:
                existing = select(ActionRow).where(ActionRow.event_id == event_id)
                return [action_of(r) for r in session.scalars(existing.order_by(ActionRow.id))]
            rows = [
                self._new_action(
                    session,
                    request,
                    key=f"event-{event_id}-{index}-{request.type.value}",
                    source="policy",
                    event_id=event_id,
                    fault_id=event.fault_id,
                    now=now,
                )
                for index, request in enumerate(requests)
            ]
            event.handled_at = now
            if policy_error is not None:
                event.policy_error = policy_error[:2000]
            session.flush()
            return [action_of(r) for r in rows]
