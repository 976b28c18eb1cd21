"""All reads and writes of the database. Methods are synchronous and short; async callers
run them in a worker thread. Each public method is one transaction."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine, Insert, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from supervisor.domain import (
    NODE_FAILURE_EVENTS,
    RESTART_ACTIONS,
    ActionRecord,
    ActionRequest,
    ActionStatus,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    Fault,
    JobView,
    NodeState,
    NodeView,
    ProgressSample,
    WorkerState,
    WorkerView,
    utcnow,
)
from supervisor.errors import SupervisorError
from supervisor.notifications.notice import Delivery, DeliveryStatus, NewDelivery, Notice
from supervisor.store.incidents import attach_event
from supervisor.store.models import (
    ActionRow,
    CheckpointReportRow,
    CounterRow,
    EventRow,
    FaultRow,
    JobRow,
    NodeRow,
    NotificationDeliveryRow,
    ProgressSampleRow,
)
from supervisor.store.retention import HistoryTable, PrunedBatch, prune_batch, prune_extent
from supervisor.xid import blames_node

NODE_SCOPE = "node"
JOB_SCOPE = "job"
#: A dry-run supervisor's own action counts: never read by a live one, nor the reverse.
DRY_RUN_JOB_SCOPE = "job:dry_run"
FAILURES = "failures"
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


@dataclass(frozen=True, slots=True)
class PolicyCounts:
    node_failures: dict[str, int]
    action_counts: dict[tuple[str, ActionType], int]
    restarts_in_window: dict[str, int]


@dataclass(frozen=True, slots=True)
class JobHistory:
    """What the store knows of one job, oldest first: the input of its goodput.

    ``checkpoints`` summarises the reports of all ranks for one checkpoint (same event,
    tier and step, all within the grouping window) as one report (node ``*``, the latest
    time, the longest duration, the mean ``size_bytes`` and ``total_s`` of the ranks that
    gave them), so reading them does not grow with the number of ranks;
    a step saved again later (after a rollback) comes as its individual reports.
    ``checkpoint_reports`` is the number of reports stored.
    """

    job: JobView | None
    created_at: datetime | None
    events: list[Event]
    actions: list[ActionRecord]
    checkpoints: list[CheckpointReport]
    samples: list[ProgressSample]
    checkpoint_reports: int = 0


class InvalidCursor(SupervisorError, ValueError):
    """A page cursor that is not one this API handed out."""


def _decode_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    try:
        value = int(cursor)
    except ValueError:
        raise InvalidCursor("cursor: not a cursor returned by this API") from None
    if not 1 <= value <= MAX_ID:
        raise InvalidCursor("cursor: not a cursor returned by this API")
    return value


class Store:
    def __init__(self, engine: Engine, *, dry_run: bool = False) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        #: Actions recorded here are what a dry-run supervisor would have done: marked so,
        #: and counted apart (restart budget, in-job restarts) from those carried out.
        self.dry_run = dry_run
        self._job_scope = DRY_RUN_JOB_SCOPE if dry_run else JOB_SCOPE

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        """Raise unless the database answers a trivial query (the readiness probe)."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    # --- sensor output ----------------------------------------------------------------

    def record(
        self,
        events: Sequence[Event],
        nodes: Sequence[NodeView] = (),
        jobs: Sequence[JobView] = (),
    ) -> list[Event]:
        """Persist new events and changed nodes and jobs; return the events with ids.

        A node failure also bumps the node's failure counter in the same transaction, so
        the count the policy sees is exactly the number of failures recorded.
        """
        now = utcnow()
        with self._sessions.begin() as session:
            for job in jobs:
                self._upsert_job(session, job, now)
            for node in nodes:
                self._upsert_node(session, node, now)
            rows = [
                EventRow(
                    type=e.type.value,
                    time=e.time,
                    node=e.node,
                    job=e.job,
                    rank=e.rank,
                    details=dict(e.details),
                    fault_id=e.fault_id,
                )
                for e in events
            ]
            session.add_all(rows)
            session.flush()
            for event in events:
                # An XID of the application's own is not the node's failure.
                if event.node and event.type in NODE_FAILURE_EVENTS and blames_node(event):
                    self._bump(session, NODE_SCOPE, event.node, FAILURES, now)
            return [_event(row) for row in rows]

    def _upsert_node(self, session: Session, node: NodeView, now: datetime) -> None:
        session.merge(
            NodeRow(
                name=node.name,
                state=node.state.value,
                job=node.job,
                alive=node.alive,
                cordoned=node.cordoned,
                flapping=node.flapping,
                last_heartbeat=node.last_heartbeat,
                workers=[
                    {
                        "rank": w.rank,
                        "local_rank": w.local_rank,
                        "pid": w.pid,
                        "state": w.state.value,
                        "step": w.step,
                        "exit_code": w.exit_code,
                    }
                    for w in node.workers
                ],
                updated_at=now,
            )
        )

    def _upsert_job(self, session: Session, job: JobView, now: datetime) -> None:
        row = session.get(JobRow, job.name)
        if row is None:
            row = JobRow(name=job.name, created_at=now)
            session.add(row)
        row.num_dp_replicas = job.num_dp_replicas
        row.min_num_dp_replicas = job.min_num_dp_replicas
        row.max_num_dp_replicas = job.max_num_dp_replicas
        row.num_nodes_per_dp = job.num_nodes_per_dp
        row.step_interval_s = job.step_interval_s
        row.updated_at = now

    def _bump(self, session: Session, scope: str, key: str, name: str, now: datetime) -> None:
        row = session.get(CounterRow, (scope, key, name), with_for_update=True)
        if row is None:
            session.add(CounterRow(scope=scope, key=key, name=name, value=1, updated_at=now))
            session.flush()
        else:
            row.value += 1
            row.updated_at = now

    def load_nodes(self) -> list[NodeView]:
        with self._sessions() as session:
            return [_node(r) for r in session.scalars(select(NodeRow).order_by(NodeRow.name))]

    def load_jobs(self) -> list[JobView]:
        with self._sessions() as session:
            return [_job(r) for r in session.scalars(select(JobRow).order_by(JobRow.name))]

    # --- events -----------------------------------------------------------------------

    def get_event(self, event_id: int) -> Event | None:
        with self._sessions() as session:
            row = session.get(EventRow, event_id)
            return _event(row) if row else None

    def list_events(
        self, filters: EventFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[Event]:
        after = _decode_cursor(cursor)
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
        return Page([_event(r) for r in rows], str(rows[-1].id) if more and rows else None)

    def unhandled_events(self) -> list[Event]:
        query = select(EventRow).where(EventRow.handled_at.is_(None)).order_by(EventRow.id)
        with self._sessions() as session:
            return [_event(r) for r in session.scalars(query)]

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
                return [_action(r) for r in session.scalars(existing.order_by(ActionRow.id))]
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
            return [_action(r) for r in rows]

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
                return _action(row), True
        except IntegrityError:
            with self._sessions() as session:
                query = select(ActionRow).where(ActionRow.idempotency_key == key)
                existing = session.scalars(query).one()
                return _action(existing), False

    def _new_action(
        self,
        session: Session,
        request: ActionRequest,
        *,
        key: str,
        source: str,
        now: datetime,
        event_id: int | None = None,
        fault_id: int | None = None,
    ) -> ActionRow:
        row = ActionRow(
            idempotency_key=key,
            type=request.type.value,
            status=ActionStatus.PENDING.value,
            source=source,
            job=request.job,
            node=request.node,
            params=dict(request.params),
            reason=request.reason,
            event_id=event_id,
            fault_id=fault_id,
            attempts=0,
            created_at=now,
            dry_run=self.dry_run,
        )
        session.add(row)
        if request.job:
            self._bump(session, self._job_scope, request.job, request.type.value, now)
        return row

    def attach_event(self, event_id: int, action_id: int) -> ActionRecord | None:
        """Attach the event to the incident of the action (store/incidents.py): the action
        as it stands then, or None when the event was handled already."""
        failures = (NODE_SCOPE, FAILURES)  # the incident counts once against its node
        attached = attach_event(self._sessions, event_id, action_id, failures=failures)
        return self.get_action(action_id) if attached else None

    def get_action(self, action_id: int) -> ActionRecord | None:
        with self._sessions() as session:
            row = session.get(ActionRow, action_id)
            return _action(row) if row else None

    def start_attempt(self, action_id: int) -> ActionRecord:
        now = utcnow()
        with self._sessions.begin() as session:
            row = session.get(ActionRow, action_id, with_for_update=True)
            if row is None:
                raise KeyError(action_id)
            row.status = ActionStatus.RUNNING.value
            row.attempts += 1
            row.error = None
            if row.started_at is None:
                row.started_at = now
            return _action(row)

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
            row.status = status.value
            row.error = error
            row.result = result
            row.finished_at = utcnow()
            return _action(row)

    def unfinished_actions(self) -> list[ActionRecord]:
        unfinished = [ActionStatus.PENDING.value, ActionStatus.RUNNING.value]
        query = select(ActionRow).where(ActionRow.status.in_(unfinished)).order_by(ActionRow.id)
        with self._sessions() as session:
            return [_action(r) for r in session.scalars(query)]

    def list_actions(
        self, filters: ActionFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[ActionRecord]:
        after = _decode_cursor(cursor)
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
        return Page([_action(r) for r in rows], str(rows[-1].id) if more and rows else None)

    # --- policy counters --------------------------------------------------------------

    def policy_counts(self, window_start: datetime) -> PolicyCounts:
        restart_types = [t.value for t in RESTART_ACTIONS]
        with self._sessions() as session:
            counters = list(session.scalars(select(CounterRow)))
            recent = session.execute(
                select(ActionRow.job, func.count())
                .where(ActionRow.type.in_(restart_types))
                .where(ActionRow.created_at >= window_start)
                .where(ActionRow.job.is_not(None))
                .where(ActionRow.dry_run == self.dry_run)
                .group_by(ActionRow.job)
            ).all()
        node_failures = {
            c.key: c.value for c in counters if c.scope == NODE_SCOPE and c.name == FAILURES
        }
        action_counts = {
            (c.key, ActionType(c.name)): c.value
            for c in counters
            if c.scope == self._job_scope and c.name in ActionType.__members__.values()
        }
        return PolicyCounts(
            node_failures=node_failures,
            action_counts=action_counts,
            restarts_in_window={job: count for job, count in recent if job},
        )

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
            return _fault(row)

    def end_fault(self, fault_id: int) -> Fault | None:
        with self._sessions.begin() as session:
            row = session.get(FaultRow, fault_id, with_for_update=True)
            if row is None:
                return None
            if row.active:
                row.active = False
                row.ended_at = utcnow()
            return _fault(row)

    def get_fault(self, fault_id: int) -> Fault | None:
        with self._sessions() as session:
            row = session.get(FaultRow, fault_id)
            return _fault(row) if row else None

    def list_faults(self, active: bool | None = None) -> list[Fault]:
        query = select(FaultRow).order_by(FaultRow.id.desc())
        if active is not None:
            query = query.where(FaultRow.active.is_(active))
        with self._sessions() as session:
            return [_fault(r) for r in session.scalars(query)]

    def linked_to_fault(self, fault_id: int) -> tuple[list[Event], list[ActionRecord]]:
        with self._sessions() as session:
            events = session.scalars(
                select(EventRow).where(EventRow.fault_id == fault_id).order_by(EventRow.id)
            )
            actions = session.scalars(
                select(ActionRow).where(ActionRow.fault_id == fault_id).order_by(ActionRow.id)
            )
            return [_event(e) for e in events], [_action(a) for a in actions]

    # --- goodput history ----------------------------------------------------------------

    def record_checkpoint_reports(self, reports: Sequence[CheckpointReport]) -> tuple[int, int]:
        """Store the reports not stored yet (by ``report_id``), committed on return.

        Returns (stored, duplicates): a batch sent again stores nothing twice.
        """
        new, duplicates = self.record_new_checkpoint_reports(reports)
        return len(new), duplicates

    def record_new_checkpoint_reports(
        self, reports: Sequence[CheckpointReport]
    ) -> tuple[list[CheckpointReport], int]:
        """As `record_checkpoint_reports`; returns the reports stored now (not those
        stored before) and the number of duplicates."""
        if not reports:
            return [], 0
        now = utcnow()
        unique = list({r.report_id: r for r in reports}.values())
        with self._sessions.begin() as session:
            known = set(
                session.scalars(
                    select(CheckpointReportRow.report_id).where(
                        CheckpointReportRow.report_id.in_([r.report_id for r in unique])
                    )
                )
            )
            new = [r for r in unique if r.report_id not in known]
            if new:
                # ON CONFLICT DO NOTHING: a concurrent retry of the same batch is harmless.
                session.execute(
                    self._insert_ignoring_duplicates(),
                    [
                        {
                            "report_id": r.report_id,
                            "node": r.node,
                            "job": r.job,
                            "rank": r.rank,
                            "event": r.event,
                            "step": r.step,
                            "duration_s": r.duration_s,
                            "tier": r.tier,
                            "time": r.time,
                            "received_at": now,
                            "bytes": r.size_bytes,
                            "total_s": r.total_s,
                            "error": r.error,
                        }
                        for r in new
                    ],
                )
        return new, len(reports) - len(new)

    def _insert_ignoring_duplicates(self) -> Insert:
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            return postgresql.insert(CheckpointReportRow).on_conflict_do_nothing(
                index_elements=["report_id"]
            )
        if dialect == "sqlite":
            return sqlite.insert(CheckpointReportRow).on_conflict_do_nothing(
                index_elements=["report_id"]
            )
        return insert(CheckpointReportRow)

    def record_progress_samples(self, samples: Sequence[ProgressSample]) -> None:
        if not samples:
            return
        with self._sessions.begin() as session:
            session.add_all(ProgressSampleRow(job=s.job, step=s.step, time=s.time) for s in samples)

    def job_history(self, job: str, *, group_window_s: float = 30.0) -> JobHistory:
        """Events, actions, checkpoint reports (see :class:`JobHistory`) and progress
        samples of ``job``, oldest first, read in one transaction."""
        c = CheckpointReportRow
        by_checkpoint = (
            select(
                c.event,
                c.tier,
                c.step,
                func.count(),
                func.min(c.time),
                func.max(c.time),
                func.max(c.duration_s),
                func.avg(c.bytes),
                func.avg(c.total_s),
            )
            # Failed saves are no checkpoint: goodput reads saves and loads.
            .where(c.job == job, c.event != "failed")
            .group_by(c.event, c.tier, c.step)
        )
        p = ProgressSampleRow
        with self._sessions() as session, session.begin():
            row = session.get(JobRow, job)
            events = session.scalars(
                select(EventRow).where(EventRow.job == job).order_by(EventRow.id)
            )
            actions = session.scalars(
                select(ActionRow).where(ActionRow.job == job).order_by(ActionRow.id)
            )
            checkpoints: list[CheckpointReport] = []
            spread: list[tuple[str, str, int]] = []
            total = 0
            for event, tier, step, count, first, last, longest, size, seconds in session.execute(
                by_checkpoint
            ):
                total += count
                if (last - first).total_seconds() > group_window_s:
                    spread.append((event, tier, step))
                    continue
                checkpoints.append(
                    CheckpointReport(
                        f"{count} report(s)",
                        "*",
                        job,
                        0,
                        event,
                        step,
                        longest,
                        tier,
                        last,
                        # PostgreSQL averages a BIGINT as a NUMERIC (a Decimal).
                        size_bytes=round(size) if size is not None else None,
                        total_s=float(seconds) if seconds is not None else None,
                    )
                )
            for event, tier, step in spread:
                rows = session.scalars(
                    select(c).where(c.job == job, c.event == event, c.tier == tier, c.step == step)
                )
                checkpoints.extend(_checkpoint(r) for r in rows)
            checkpoints.sort(key=lambda r: r.time)
            samples = session.execute(
                select(p.step, p.time).where(p.job == job).order_by(p.time, p.id)
            )
            return JobHistory(
                job=_job(row) if row is not None else None,
                created_at=row.created_at if row is not None else None,
                events=[_event(e) for e in events],
                actions=[_action(a) for a in actions],
                checkpoints=checkpoints,
                samples=[ProgressSample(job=job, step=step, time=t) for step, t in samples],
                checkpoint_reports=total,
            )

    def list_checkpoint_reports(
        self, job: str | None = None, limit: int = 100
    ) -> list[CheckpointReport]:
        """The newest checkpoint reports (of ``job``), newest first."""
        query = select(CheckpointReportRow).order_by(
            CheckpointReportRow.time.desc(), CheckpointReportRow.id.desc()
        )
        if job is not None:
            query = query.where(CheckpointReportRow.job == job)
        with self._sessions() as session:
            return [_checkpoint(r) for r in session.scalars(query.limit(limit))]

    # --- notification deliveries --------------------------------------------------------

    def create_deliveries(self, new: Sequence[NewDelivery]) -> list[Delivery]:
        """Record deliveries pending; one already recorded (same route and item) is not
        recorded again and not returned."""
        if not new:
            return []
        now = utcnow()
        d = NotificationDeliveryRow
        with self._sessions.begin() as session:
            known = {
                (route, kind, item_id)
                for route, kind, item_id in session.execute(
                    select(d.route, d.item_kind, d.item_id).where(
                        d.item_id.in_({n.notice.id for n in new})
                    )
                )
            }
            rows = []
            for item in new:
                key = (item.route, item.notice.kind, item.notice.id)
                if key in known:
                    continue
                known.add(key)
                rows.append(
                    NotificationDeliveryRow(
                        route=item.route,
                        sink=item.sink,
                        item_kind=item.notice.kind,
                        item_id=item.notice.id,
                        item_type=item.notice.type,
                        job=item.notice.job,
                        node=item.notice.node,
                        notice=item.notice.to_json(),
                        status=DeliveryStatus.PENDING.value,
                        attempts=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
            session.add_all(rows)
            session.flush()
            return [_delivery(r) for r in rows]

    def pending_deliveries(self, route: str, limit: int = 100) -> list[Delivery]:
        """The route's pending deliveries, oldest first."""
        d = NotificationDeliveryRow
        query = (
            select(d)
            .where(d.status == DeliveryStatus.PENDING.value, d.route == route)
            .order_by(d.id)
            .limit(limit)
        )
        with self._sessions() as session:
            return [_delivery(r) for r in session.scalars(query)]

    def record_delivery_attempt(
        self, delivery_id: int, status: DeliveryStatus, error: str | None = None
    ) -> Delivery:
        """Count an attempt and its result: still pending (to be tried again), delivered
        or failed."""
        now = utcnow()
        with self._sessions.begin() as session:
            row = session.get(NotificationDeliveryRow, delivery_id, with_for_update=True)
            if row is None:
                raise KeyError(delivery_id)
            row.attempts += 1
            row.status = status.value
            row.last_error = error
            row.updated_at = now
            if status is not DeliveryStatus.PENDING:
                row.finished_at = now
            return _delivery(row)

    def fail_pending_deliveries(self, *, except_routes: Collection[str], error: str) -> int:
        """Give up the pending deliveries of routes no longer configured."""
        d = NotificationDeliveryRow
        now = utcnow()
        with self._sessions.begin() as session:
            result = session.execute(
                update(d)
                .where(d.status == DeliveryStatus.PENDING.value, d.route.not_in(except_routes))
                .values(
                    status=DeliveryStatus.FAILED.value,
                    last_error=error,
                    updated_at=now,
                    finished_at=now,
                )
            )
            return int(getattr(result, "rowcount", 0) or 0)

    def get_delivery(self, delivery_id: int) -> Delivery | None:
        with self._sessions() as session:
            row = session.get(NotificationDeliveryRow, delivery_id)
            return _delivery(row) if row else None

    def list_deliveries(
        self, filters: DeliveryFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[Delivery]:
        after = _decode_cursor(cursor)
        d = NotificationDeliveryRow
        query = select(d).order_by(d.id.desc()).limit(limit + 1)
        if filters.status:
            query = query.where(d.status == filters.status.value)
        if filters.route:
            query = query.where(d.route == filters.route)
        if filters.kind:
            query = query.where(d.item_kind == filters.kind)
        if filters.item_id is not None:
            query = query.where(d.item_id == filters.item_id)
        if filters.job:
            query = query.where(d.job == filters.job)
        if after is not None:
            query = query.where(d.id < after)
        with self._sessions() as session:
            rows = list(session.scalars(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page([_delivery(r) for r in rows], str(rows[-1].id) if more and rows else None)

    # --- retention ----------------------------------------------------------------------

    def prune_extent(self, table: HistoryTable, cutoff: datetime) -> int | None:
        """The highest id of a row of ``table`` older than ``cutoff`` (None: no such row)."""
        with self.engine.connect() as conn:
            return prune_extent(conn, table, cutoff)

    def prune(
        self, table: HistoryTable, cutoff: datetime, *, after: int, until: int, limit: int
    ) -> PrunedBatch:
        """Delete ``table``'s rows older than ``cutoff`` that nothing still needs among the
        next ``limit`` ids above ``after`` (see :mod:`supervisor.store.retention`), in one
        short transaction."""
        with self.engine.begin() as conn:
            return prune_batch(conn, table, cutoff, after=after, until=until, limit=limit)


def _event(row: EventRow) -> Event:
    return Event(
        id=row.id,
        type=EventType(row.type),
        time=row.time,
        node=row.node,
        job=row.job,
        rank=row.rank,
        details=row.details or {},
        fault_id=row.fault_id,
        policy_error=row.policy_error,
        incident_action_id=row.incident_action_id,
    )


def _action(row: ActionRow) -> ActionRecord:
    return ActionRecord(
        id=row.id,
        type=ActionType(row.type),
        status=ActionStatus(row.status),
        idempotency_key=row.idempotency_key,
        source=row.source,
        created_at=row.created_at,
        job=row.job,
        node=row.node,
        params=row.params or {},
        reason=row.reason,
        event_id=row.event_id,
        fault_id=row.fault_id,
        attempts=row.attempts,
        error=row.error,
        result=row.result,
        started_at=row.started_at,
        finished_at=row.finished_at,
        dry_run=row.dry_run,
        attached_events=tuple(row.attached_events or ()),
    )


def _node(row: NodeRow) -> NodeView:
    return NodeView(
        name=row.name,
        state=NodeState(row.state),
        job=row.job,
        alive=row.alive,
        last_heartbeat=row.last_heartbeat,
        workers=tuple(
            WorkerView(
                rank=w["rank"],
                local_rank=w["local_rank"],
                pid=w.get("pid"),
                state=WorkerState(w["state"]),
                step=w.get("step"),
                exit_code=w.get("exit_code"),
            )
            for w in row.workers or ()
        ),
        cordoned=row.cordoned,
        flapping=row.flapping,
    )


def _job(row: JobRow) -> JobView:
    return JobView(
        name=row.name,
        num_dp_replicas=row.num_dp_replicas,
        min_num_dp_replicas=row.min_num_dp_replicas,
        max_num_dp_replicas=row.max_num_dp_replicas,
        num_nodes_per_dp=row.num_nodes_per_dp,
        step_interval_s=row.step_interval_s,
    )


def _fault(row: FaultRow) -> Fault:
    return Fault(
        id=row.id,
        kind=row.kind,
        created_at=row.created_at,
        node=row.node,
        job=row.job,
        params=row.params or {},
        active=row.active,
        ended_at=row.ended_at,
    )


def _checkpoint(row: CheckpointReportRow) -> CheckpointReport:
    return CheckpointReport(
        report_id=row.report_id,
        node=row.node,
        job=row.job,
        rank=row.rank,
        event=row.event,
        step=row.step,
        duration_s=row.duration_s,
        tier=row.tier,
        time=row.time,
        size_bytes=row.bytes,
        total_s=row.total_s,
        error=row.error,
    )


def _delivery(row: NotificationDeliveryRow) -> Delivery:
    return Delivery(
        id=row.id,
        route=row.route,
        sink=row.sink,
        notice=Notice.from_json(row.notice),
        status=DeliveryStatus(row.status),
        attempts=row.attempts,
        created_at=row.created_at,
        updated_at=row.updated_at,
        last_error=row.last_error,
        finished_at=row.finished_at,
    )
