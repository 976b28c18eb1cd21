"""actions, checkpoint reports, progress samples: indexes on age, for retention

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Events have had an index on their time from the start.
    op.create_index("ix_actions_created_at", "actions", ["created_at"])
    op.create_index("ix_checkpoint_reports_time", "checkpoint_reports", ["time"])
    op.create_index("ix_progress_samples_time", "progress_samples", ["time"])


def downgrade() -> None:
    op.drop_index("ix_progress_samples_time", table_name="progress_samples")
    op.drop_index("ix_checkpoint_reports_time", table_name="checkpoint_reports")
    op.drop_index("ix_actions_created_at", table_name="actions")
