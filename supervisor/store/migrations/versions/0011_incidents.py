"""events attached to a remedy's incident; actions list the events attached to them

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("incident_action_id", _ID, nullable=True))
    with op.batch_alter_table("actions") as batch:
        batch.add_column(sa.Column("attached_events", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.drop_column("attached_events")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("incident_action_id")
