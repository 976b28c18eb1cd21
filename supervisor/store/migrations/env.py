"""Alembic environment: runs against the engine the supervisor hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, Engine, create_engine

from supervisor.store.models import Base

config = context.config
engine: Engine | None = config.attributes.get("engine")
if engine is None:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")


def _ours(name: str | None, type_: str, parents: object) -> bool:
    """The scheduler's job tables are APScheduler's (it creates them itself, see
    supervisor.schedules.scheduler): never a migration's to drop."""
    return not (type_ == "table" and (name or "").startswith("apscheduler_jobs"))


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_name=_ours,
    )
    with context.begin_transaction():
        context.run_migrations()


if engine.dialect.name == "sqlite":
    # Python's sqlite3 module opens no transaction before DDL: each CREATE TABLE was
    # committed alone, and a supervisor killed in its first migration (its leadership lost
    # meanwhile) left tables without their version, on which every later start failed
    # ("table faults already exists"). SQLite's DDL is transactional: the upgrade runs in
    # one transaction of its own, all or nothing, holding the write lock from its start
    # (IMMEDIATE), so that a second process migrating at once waits, then finds it done.
    with engine.connect() as connection:
        own = connection.execution_options(isolation_level="AUTOCOMMIT")
        own.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            _run(own)
        except BaseException:
            own.exec_driver_sql("ROLLBACK")
            raise
        own.exec_driver_sql("COMMIT")
else:
    # PostgreSQL's DDL is transactional: the upgrade runs in this one transaction. Its
    # first statement waits for any other process upgrading this schema (a second
    # replica starting at once), which then finds it done rather than failing on a
    # table the first one created.
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "SELECT pg_advisory_xact_lock(hashtext('resiliency-supervisor schema '"
            " || current_schema()))"
        )
        _run(connection)
