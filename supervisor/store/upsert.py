"""One row written whether or not it exists yet, in one statement: `INSERT ... ON CONFLICT
DO UPDATE`, as SQLite and PostgreSQL both spell it.

Records run in threads of their own (a heartbeat's, a deadline's, a fault injection's):
read-then-insert let two of them insert the same new row, and the second transaction,
events and all, failed on the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from supervisor.store.models import Base


def upsert(
    session: Session,
    model: type[Base],
    values: Mapping[str, Any],
    key: Sequence[str],
    update: Mapping[str, Any] | None = None,
    *,
    keep: Sequence[str] = (),
) -> None:
    """Insert `values`; where a row with the same `key` exists, set `update` on it (by
    default every value but the key's and those named in `keep`)."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(model).values(dict(values))
    changes = (
        dict(update)
        if update is not None
        else {
            name: statement.excluded[name]
            for name in values
            if name not in key and name not in keep
        }
    )
    session.execute(statement.on_conflict_do_update(index_elements=list(key), set_=changes))
