"""checkpoint reports: bytes and total seconds

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_reports", schema=None) as batch_op:
        # Nullable: rows written before this revision, and reports from clients that do
        # not send them, have neither.
        batch_op.add_column(sa.Column("bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("total_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_reports", schema=None) as batch_op:
        batch_op.drop_column("total_s")
        batch_op.drop_column("bytes")
