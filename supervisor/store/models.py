"""The database schema: SQLAlchemy 2 typed ORM models. Changes go through Alembic."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Constraint names are fixed so migrations behave the same on SQLite and PostgreSQL.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# BIGINT ids on PostgreSQL; SQLite only auto-increments an INTEGER PRIMARY KEY.
Id = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class NodeRow(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(253), primary_key=True)
    state: Mapped[str] = mapped_column(String(32))
    job: Mapped[str | None] = mapped_column(String(253), index=True)
    alive: Mapped[bool]
    cordoned: Mapped[bool] = mapped_column(default=False)
    flapping: Mapped[bool] = mapped_column(default=False)
    last_heartbeat: Mapped[datetime | None]
    # Worker states as last reported, so a restarted supervisor does not mistake them for
    # new transitions. Written only when they change, never per heartbeat.
    workers: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    updated_at: Mapped[datetime]


class JobRow(Base):
    __tablename__ = "jobs"

    name: Mapped[str] = mapped_column(String(253), primary_key=True)
    num_dp_replicas: Mapped[int]
    min_num_dp_replicas: Mapped[int]
    max_num_dp_replicas: Mapped[int]
    num_nodes_per_dp: Mapped[int]
    # The longest step interval seen past the warm-up (the learned hang timeout is this
    # times the safety factor), so that a restarted supervisor does not learn again from
    # the floor. Null while the job is in its warm-up.
    step_interval_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class FaultRow(Base):
    __tablename__ = "faults"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(64))
    node: Mapped[str | None] = mapped_column(String(253))
    job: Mapped[str | None] = mapped_column(String(253))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    active: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_unhandled", "handled_at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    type: Mapped[str] = mapped_column(String(64), index=True)
    time: Mapped[datetime] = mapped_column(index=True)
    node: Mapped[str | None] = mapped_column(String(253), index=True)
    job: Mapped[str | None] = mapped_column(String(253), index=True)
    rank: Mapped[int | None]
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    fault_id: Mapped[int | None] = mapped_column(ForeignKey("faults.id"), index=True)
    # Set in the same transaction that records the actions the policy chose.
    handled_at: Mapped[datetime | None]
    # The policy raised on this event (it then decided nothing): what it raised.
    policy_error: Mapped[str | None] = mapped_column(String(2000))
    # Attached to the incident of this remedy: handled with no action of its own.
    incident_action_id: Mapped[int | None] = mapped_column(Id)


class ActionRow(Base):
    __tablename__ = "actions"
    __table_args__ = (
        Index("ix_actions_job_type_created", "job", "type", "created_at"),
        # Retention finds old actions of every job by age.
        Index("ix_actions_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), unique=True)
    type: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    source: Mapped[str] = mapped_column(String(32))
    job: Mapped[str | None] = mapped_column(String(253))
    node: Mapped[str | None] = mapped_column(String(253), index=True)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    reason: Mapped[str] = mapped_column(Text, default="")
    event_id: Mapped[int | None] = mapped_column(ForeignKey("events.id"), index=True)
    fault_id: Mapped[int | None] = mapped_column(ForeignKey("faults.id"), index=True)
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # Recorded by a dry-run supervisor: what it would have done, nothing was done.
    dry_run: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Ids of the events attached to this remedy's incident, in the order they came.
    # (Null on rows from before the column: none.)
    attached_events: Mapped[list[int] | None] = mapped_column(JSON, default=list)


class CounterRow(Base):
    """Counters the policy relies on (node failures, restarts), kept across restarts."""

    __tablename__ = "policy_counters"

    scope: Mapped[str] = mapped_column(String(16), primary_key=True)
    key: Mapped[str] = mapped_column(String(253), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(default=0)
    updated_at: Mapped[datetime]


class CheckpointReportRow(Base):
    """A checkpoint saved or loaded by a worker, as its host monitor forwarded it (goodput).

    ``report_id`` is the host monitor's id for the report: a retried batch inserts nothing
    twice."""

    __tablename__ = "checkpoint_reports"
    __table_args__ = (
        Index("ix_checkpoint_reports_job_time", "job", "time"),
        # Retention finds old reports of every job by age.
        Index("ix_checkpoint_reports_time", "time"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    report_id: Mapped[str] = mapped_column(String(200), unique=True)
    node: Mapped[str] = mapped_column(String(253))
    job: Mapped[str | None] = mapped_column(String(253))
    rank: Mapped[int]
    event: Mapped[str] = mapped_column(String(16))
    step: Mapped[int] = mapped_column(BigInteger)
    duration_s: Mapped[float] = mapped_column(Float)  # blocking the training loop
    tier: Mapped[str] = mapped_column(String(32))
    time: Mapped[datetime]
    received_at: Mapped[datetime]
    # Optional in a report (older clients leave them out): the rank's checkpoint size, and
    # the seconds from the start of the save or load to its commit.
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    total_s: Mapped[float | None] = mapped_column(Float)
    # Why a save failed (`failed` reports only).
    error: Mapped[str | None] = mapped_column(String(1000))


class ProgressSampleRow(Base):
    """A job's step at a time, sampled every ``goodput_sample_period_s`` while it moves
    (never per heartbeat): the step progress goodput is computed from."""

    __tablename__ = "progress_samples"
    __table_args__ = (
        Index("ix_progress_samples_job_time", "job", "time"),
        # Retention finds old samples of every job by age.
        Index("ix_progress_samples_time", "time"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(253))
    step: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[datetime]


class NotificationDeliveryRow(Base):
    """A notice (an event or finished action) sent to one notification route: recorded
    pending before the first attempt, so a restart resumes what was not delivered.

    The notice is kept whole: events and actions may be pruned before their delivery is
    done. One row per route and item: routing the same item again adds nothing."""

    __tablename__ = "notification_deliveries"
    __table_args__ = (
        UniqueConstraint("route", "item_kind", "item_id", name="uq_notification_deliveries_item"),
        # Each route's sender reads its pending deliveries, oldest first.
        Index("ix_notification_deliveries_status_route", "status", "route", "id"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    route: Mapped[str] = mapped_column(String(100))
    sink: Mapped[str] = mapped_column(String(32))
    item_kind: Mapped[str] = mapped_column(String(16))
    item_id: Mapped[int] = mapped_column(BigInteger)
    item_type: Mapped[str] = mapped_column(String(64))
    job: Mapped[str | None] = mapped_column(String(253), index=True)
    node: Mapped[str | None] = mapped_column(String(253))
    notice: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(index=True)  # retention
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class LeaderEpochRow(Base):
    """The acting supervisor's epoch (resiliency_protocol/leaders.py): one row, taken one
    higher by each supervisor that starts acting, carried on its commands to host
    monitors. Outlives Leases, which start their own count over when made again."""

    __tablename__ = "leader_epochs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    epoch: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(253))
    acquired_at: Mapped[datetime]


class JobBudgetRow(Base):
    """A job's restart budget as the controller judges it (supervisor/controller/budget.py),
    so that a restarted or newly elected supervisor goes on where the last one stopped:
    remedies without progress, the step they stood at, whether the job was given up, an
    operator's reset. Written when it changes, never per heartbeat. `scope`: a live or a
    dry-run supervisor's (supervisor/store/base.py), never read by the other."""

    __tablename__ = "job_budgets"

    scope: Mapped[str] = mapped_column(String(16), primary_key=True)
    job: Mapped[str] = mapped_column(String(253), primary_key=True)
    no_progress: Mapped[int] = mapped_column(default=0)
    stood_at: Mapped[int | None] = mapped_column(BigInteger)
    #: The last event whose remedy was counted (a retried decision counts once).
    counted_event: Mapped[int | None] = mapped_column(BigInteger)
    given_up: Mapped[str | None] = mapped_column(Text)
    reset_at: Mapped[datetime | None]
    #: The epoch of the supervisor that wrote it: an older one's write is refused.
    leader_epoch: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime]


class JobIncidentRow(Base):
    """Each job's newest incident (supervisor/controller/incidents.py): the remedy it
    started and what it covers, so that the events its fault goes on raising after a
    restart or a change of leader attach to it instead of starting a second remedy."""

    __tablename__ = "job_incidents"

    scope: Mapped[str] = mapped_column(String(16), primary_key=True)
    job: Mapped[str] = mapped_column(String(253), primary_key=True)
    trigger_event: Mapped[int | None] = mapped_column(BigInteger)
    action_id: Mapped[int] = mapped_column(BigInteger)
    nodes: Mapped[list[str]] = mapped_column(JSON)
    #: [node, rank, pid] of the job's workers when the remedy was decided.
    workers: Mapped[list[list[Any]]] = mapped_column(JSON)
    opened_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    failed: Mapped[bool] = mapped_column(default=False)
    #: The epoch of the supervisor that wrote it: an older one's write is refused.
    leader_epoch: Mapped[int | None] = mapped_column(BigInteger)
