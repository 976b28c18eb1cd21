"""job_budgets, job_incidents: the controller's restart budgets, give-ups and newest
incidents, kept across restarts and changes of leader

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_budgets",
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=False),
        sa.Column("no_progress", sa.Integer(), nullable=False),
        sa.Column("stood_at", sa.BigInteger(), nullable=True),
        sa.Column("counted_event", sa.BigInteger(), nullable=True),
        sa.Column("given_up", sa.Text(), nullable=True),
        sa.Column("reset_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "job", name=op.f("pk_job_budgets")),
    )
    op.create_table(
        "job_incidents",
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=False),
        sa.Column("trigger_event", sa.BigInteger(), nullable=True),
        sa.Column("action_id", sa.BigInteger(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("workers", sa.JSON(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed", sa.Boolean(), nullable=False),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("scope", "job", name=op.f("pk_job_incidents")),
    )


def downgrade() -> None:
    op.drop_table("job_incidents")
    op.drop_table("job_budgets")
