"""goodput history: checkpoint reports and progress samples

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "checkpoint_reports",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("report_id", sa.String(length=200), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_reports")),
        sa.UniqueConstraint("report_id", name=op.f("uq_checkpoint_reports_report_id")),
    )
    op.create_index("ix_checkpoint_reports_job_time", "checkpoint_reports", ["job", "time"])
    op.create_table(
        "progress_samples",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("job", sa.String(length=253), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_samples")),
    )
    op.create_index("ix_progress_samples_job_time", "progress_samples", ["job", "time"])


def downgrade() -> None:
    op.drop_index("ix_progress_samples_job_time", table_name="progress_samples")
    op.drop_table("progress_samples")
    op.drop_index("ix_checkpoint_reports_job_time", table_name="checkpoint_reports")
    op.drop_table("checkpoint_reports")
