"""notification deliveries: each notice sent to a route, its status and attempts

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "notification_deliveries",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("route", sa.String(length=100), nullable=False),
        sa.Column("sink", sa.String(length=32), nullable=False),
        sa.Column("item_kind", sa.String(length=16), nullable=False),
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("item_type", sa.String(length=64), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("notice", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification_deliveries")),
        sa.UniqueConstraint(
            "route", "item_kind", "item_id", name="uq_notification_deliveries_item"
        ),
    )
    op.create_index(
        "ix_notification_deliveries_status_route",
        "notification_deliveries",
        ["status", "route", "id"],
    )
    op.create_index("ix_notification_deliveries_job", "notification_deliveries", ["job"])


def downgrade() -> None:
    op.drop_index("ix_notification_deliveries_job", table_name="notification_deliveries")
    op.drop_index("ix_notification_deliveries_status_route", table_name="notification_deliveries")
    op.drop_table("notification_deliveries")
