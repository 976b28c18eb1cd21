"""Deleting old history in small batches, keeping every row something still needs.

A pass over a table first finds the highest id of a row older than the cutoff (a range
scan of the index on the table's time column), then walks the ids up to it in windows of
``limit`` rows. One batch is one short transaction that deletes, within one window, the
rows older than the cutoff that are not protected. Each batch thus reads at most
``limit`` rows by primary key whatever the table's size, and rows that are kept are read
once per pass. What is kept whatever its age:

- actions not finished (pending, running): the controller resumes them after a restart;
- actions and events of an active fault: the fault's report lists them;
- events not handled yet (the controller handles them after a restart), and events an
  action still refers to (its foreign key): actions are pruned before events;
- each job's newest progress samples (those at its newest time): the step goodput
  reports last;
- notification deliveries still pending (their sender resumes them after a restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import ColumnElement, Connection, delete, exists, func, select
from sqlalchemy.orm import InstrumentedAttribute, aliased

from supervisor.domain import ActionStatus
from supervisor.store.models import (
    ActionRow,
    CheckpointReportRow,
    EventRow,
    FaultRow,
    NotificationDeliveryRow,
    ProgressSampleRow,
)


class HistoryTable(StrEnum):
    ACTIONS = "actions"
    EVENTS = "events"
    CHECKPOINT_REPORTS = "checkpoint_reports"
    PROGRESS_SAMPLES = "progress_samples"
    NOTIFICATION_DELIVERIES = "notification_deliveries"


#: The order of a pass: actions refer to events, so they go first.
PRUNE_ORDER = (
    HistoryTable.ACTIONS,
    HistoryTable.EVENTS,
    HistoryTable.CHECKPOINT_REPORTS,
    HistoryTable.PROGRESS_SAMPLES,
    HistoryTable.NOTIFICATION_DELIVERIES,
)

_FINISHED = [s.value for s in ActionStatus if s.finished]
_PENDING = "pending"  # a notification delivery not yet delivered or given up

_Row = type[
    ActionRow | EventRow | CheckpointReportRow | ProgressSampleRow | NotificationDeliveryRow
]
_ROWS: dict[HistoryTable, _Row] = {
    HistoryTable.ACTIONS: ActionRow,
    HistoryTable.EVENTS: EventRow,
    HistoryTable.CHECKPOINT_REPORTS: CheckpointReportRow,
    HistoryTable.PROGRESS_SAMPLES: ProgressSampleRow,
    HistoryTable.NOTIFICATION_DELIVERIES: NotificationDeliveryRow,
}


@dataclass(frozen=True, slots=True)
class PrunedBatch:
    deleted: int
    #: The highest id of the window: where the next batch starts.
    last_id: int


_AGES: dict[HistoryTable, InstrumentedAttribute[datetime]] = {
    HistoryTable.ACTIONS: ActionRow.created_at,
    HistoryTable.EVENTS: EventRow.time,
    HistoryTable.CHECKPOINT_REPORTS: CheckpointReportRow.time,
    HistoryTable.PROGRESS_SAMPLES: ProgressSampleRow.time,
    HistoryTable.NOTIFICATION_DELIVERIES: NotificationDeliveryRow.created_at,
}


def _of_active_fault(fault_id: InstrumentedAttribute[int | None]) -> ColumnElement[bool]:
    return exists().where(FaultRow.id == fault_id, FaultRow.active.is_(True))


def _deletable(table: HistoryTable) -> list[ColumnElement[bool]]:
    """Conditions a row past the cutoff must meet to be deleted."""
    if table is HistoryTable.ACTIONS:
        a = ActionRow
        return [a.status.in_(_FINISHED), ~_of_active_fault(a.fault_id)]
    if table is HistoryTable.EVENTS:
        e = EventRow
        return [
            e.handled_at.is_not(None),
            ~exists().where(ActionRow.event_id == e.id),
            ~_of_active_fault(e.fault_id),
        ]
    if table is HistoryTable.PROGRESS_SAMPLES:
        p, newest = ProgressSampleRow, aliased(ProgressSampleRow)
        # Older than its job's newest sample: one probe of the (job, time) index per row.
        job_newest = select(func.max(newest.time)).where(newest.job == p.job)
        return [p.time < job_newest.scalar_subquery()]
    if table is HistoryTable.NOTIFICATION_DELIVERIES:
        return [NotificationDeliveryRow.status != _PENDING]
    return []


def prune_extent(conn: Connection, table: HistoryTable, cutoff: datetime) -> int | None:
    """The highest id of a row of ``table`` older than ``cutoff``: where a pass ends."""
    row = _ROWS[table]
    return conn.scalar(select(func.max(row.id)).where(_AGES[table] < cutoff))


def prune_batch(
    conn: Connection,
    table: HistoryTable,
    cutoff: datetime,
    *,
    after: int,
    until: int,
    limit: int,
) -> PrunedBatch:
    """Delete the rows of ``table`` older than ``cutoff``, protected rows excepted (see
    the module docstring), among the next ``limit`` ids above ``after`` (up to ``until``)."""
    row = _ROWS[table]
    window = select(row.id).where(row.id > after, row.id <= until).order_by(row.id)
    last = conn.scalar(window.offset(limit - 1).limit(1))
    last = until if last is None else last
    deleted = conn.execute(
        delete(row)
        .where(row.id > after, row.id <= last, _AGES[table] < cutoff, *_deletable(table))
        .returning(row.id)
    )
    return PrunedBatch(len(deleted.all()), last)
