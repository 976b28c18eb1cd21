"""Alembic environment: runs against the engine the supervisor hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine, create_engine

from supervisor.store.models import Base

config = context.config
engine: Engine | None = config.attributes.get("engine")
if engine is None:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")


def _ours(name: str | None, type_: str, parents: object) -> bool:
    """The scheduler's job tables are APScheduler's (it creates them itself, see
    supervisor.schedules.scheduler): never a migration's to drop."""
    return not (type_ == "table" and (name or "").startswith("apscheduler_jobs"))


with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_name=_ours,
    )
    with context.begin_transaction():
        context.run_migrations()
