"""Recorded actions: asked for by an operator, their attempts and their end, moved only
as the status table allows (supervisor/domain.py ACTION_TRANSITIONS)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    ActionStatus,
    utcnow,
)
from supervisor.errors import SupervisorError
from supervisor.store.base import FAILURES, NODE_SCOPE, RepositoryBase
from supervisor.store.incidents import attach_event
from supervisor.store.mappers import (
    action_of,
)
from supervisor.store.models import (
    ActionRow,
)
from supervisor.store.queries import ActionFilter, Page, decode_cursor


class ActionRecords(RepositoryBase):
    # --- actions ----------------------------------------------------------------------

    def create_action(
        self,
        request: ActionRequest,
        *,
        key: str,
        source: str,
        fault_id: int | None = None,
    ) -> tuple[ActionRecord, bool]:
        """Record an action asked for directly (by an operator). Returns (action, created);
        a repeated idempotency key returns the first action and False."""
        try:
            with self._sessions.begin() as session:
                row = self._new_action(
                    session, request, key=key, source=source, fault_id=fault_id, now=utcnow()
                )
                session.flush()
                return action_of(row), True
        except IntegrityError:
            with self._sessions() as session:
                query = select(ActionRow).where(ActionRow.idempotency_key == key)
                existing = session.scalars(query).one()
                return action_of(existing), False

    def attach_event(self, event_id: int, action_id: int) -> ActionRecord | None:
        """Attach the event to the incident of the action (store/incidents.py): the action
        as it stands then, or None when the event was handled already."""
        failures = (NODE_SCOPE, FAILURES)  # the incident counts once against its node
        attached = attach_event(self._sessions, event_id, action_id, failures=failures)
        return self.get_action(action_id) if attached else None

    def get_action(self, action_id: int) -> ActionRecord | None:
        with self._sessions() as session:
            row = session.get(ActionRow, action_id)
            return action_of(row) if row else None

    def start_attempt(self, action_id: int) -> ActionRecord:
        now = utcnow()
        with self._sessions.begin() as session:
            row = session.get(ActionRow, action_id, with_for_update=True)
            if row is None:
                raise KeyError(action_id)
            _move(row, ActionStatus.RUNNING)
            row.attempts += 1
            row.error = None
            if row.started_at is None:
                row.started_at = now
            return action_of(row)

    def note_attempt_error(self, action_id: int, error: str) -> None:
        with self._sessions.begin() as session:
            session.execute(update(ActionRow).where(ActionRow.id == action_id).values(error=error))

    def finish_action(
        self,
        action_id: int,
        status: ActionStatus,
        *,
        error: str | None = None,
        result: dict[str, Any] | None = None,
    ) -> ActionRecord:
        with self._sessions.begin() as session:
            row = session.get(ActionRow, action_id, with_for_update=True)
            if row is None:
                raise KeyError(action_id)
            _move(row, status)
            row.error = error
            row.result = result
            row.finished_at = utcnow()
            return action_of(row)

    def unfinished_actions(self) -> list[ActionRecord]:
        unfinished = [ActionStatus.PENDING.value, ActionStatus.RUNNING.value]
        query = select(ActionRow).where(ActionRow.status.in_(unfinished)).order_by(ActionRow.id)
        with self._sessions() as session:
            return [action_of(r) for r in session.scalars(query)]

    def list_actions(
        self, filters: ActionFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[ActionRecord]:
        after = decode_cursor(cursor)
        query = select(ActionRow).order_by(ActionRow.id.desc()).limit(limit + 1)
        if filters.types:
            query = query.where(ActionRow.type.in_([t.value for t in filters.types]))
        if filters.status:
            query = query.where(ActionRow.status == filters.status.value)
        if filters.node:
            query = query.where(ActionRow.node == filters.node)
        if filters.job:
            query = query.where(ActionRow.job == filters.job)
        if filters.event_id is not None:
            query = query.where(ActionRow.event_id == filters.event_id)
        if filters.dry_run is not None:
            query = query.where(ActionRow.dry_run == filters.dry_run)
        if filters.since:
            query = query.where(ActionRow.created_at >= filters.since)
        if filters.until:
            query = query.where(ActionRow.created_at < filters.until)
        if after is not None:
            query = query.where(ActionRow.id < after)
        with self._sessions() as session:
            rows = list(session.scalars(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page([action_of(r) for r in rows], str(rows[-1].id) if more and rows else None)


def _move(row: ActionRow, new: ActionStatus) -> None:
    """The action's status to `new`, if the transition table allows the move; else
    ActionStatusMove, and nothing written (a finished action is never reopened)."""
    old = ActionStatus(row.status)
    if not old.may_become(new):
        raise ActionStatusMove(row.id, old, new)
    row.status = new.value


class ActionStatusMove(SupervisorError, ValueError):
    """An action's status asked to make a move the transition table does not have."""

    def __init__(self, action_id: int, old: ActionStatus, new: ActionStatus) -> None:
        super().__init__(f"action {action_id}: {old.value} -> {new.value} is not a move it makes")
        self.action_id, self.old, self.new = action_id, old, new
