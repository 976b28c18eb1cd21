"""Injected faults and what each caused (the events and actions carrying its id)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from supervisor.domain import (
    ActionRecord,
    Event,
    Fault,
    utcnow,
)
from supervisor.store.base import RepositoryBase
from supervisor.store.mappers import (
    action_of,
    event_of,
    fault_of,
)
from supervisor.store.models import (
    ActionRow,
    EventRow,
    FaultRow,
)


class FaultRecords(RepositoryBase):
    # --- faults -----------------------------------------------------------------------

    def create_fault(
        self, kind: str, *, node: str | None, job: str | None, params: dict[str, Any]
    ) -> Fault:
        with self._sessions.begin() as session:
            row = FaultRow(
                kind=kind, node=node, job=job, params=params, active=True, created_at=utcnow()
            )
            session.add(row)
            session.flush()
            return fault_of(row)

    def end_fault(self, fault_id: int) -> Fault | None:
        with self._sessions.begin() as session:
            row = session.get(FaultRow, fault_id, with_for_update=True)
            if row is None:
                return None
            if row.active:
                row.active = False
                row.ended_at = utcnow()
            return fault_of(row)

    def get_fault(self, fault_id: int) -> Fault | None:
        with self._sessions() as session:
            row = session.get(FaultRow, fault_id)
            return fault_of(row) if row else None

    def list_faults(self, active: bool | None = None) -> list[Fault]:
        query = select(FaultRow).order_by(FaultRow.id.desc())
        if active is not None:
            query = query.where(FaultRow.active.is_(active))
        with self._sessions() as session:
            return [fault_of(r) for r in session.scalars(query)]

    def linked_to_fault(self, fault_id: int) -> tuple[list[Event], list[ActionRecord]]:
        with self._sessions() as session:
            events = session.scalars(
                select(EventRow).where(EventRow.fault_id == fault_id).order_by(EventRow.id)
            )
            actions = session.scalars(
                select(ActionRow).where(ActionRow.fault_id == fault_id).order_by(ActionRow.id)
            )
            return [event_of(e) for e in events], [action_of(a) for a in actions]
