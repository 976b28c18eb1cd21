"""checkpoint_reports: the error of a save that did not commit (`failed` reports)

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_reports") as batch:
        batch.add_column(sa.Column("error", sa.String(length=1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_reports") as batch:
        batch.drop_column("error")
