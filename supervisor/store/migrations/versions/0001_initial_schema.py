"""initial schema

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "faults",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_faults")),
    )
    op.create_table(
        "jobs",
        sa.Column("name", sa.String(length=253), nullable=False),
        sa.Column("num_dp_replicas", sa.Integer(), nullable=False),
        sa.Column("min_num_dp_replicas", sa.Integer(), nullable=False),
        sa.Column("max_num_dp_replicas", sa.Integer(), nullable=False),
        sa.Column("num_nodes_per_dp", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_jobs")),
    )
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(length=253), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("alive", sa.Boolean(), nullable=False),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("flapping", sa.Boolean(), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_nodes")),
    )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_nodes_job"), ["job"], unique=False)

    op.create_table(
        "policy_counters",
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("key", sa.String(length=253), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", "name", name=op.f("pk_policy_counters")),
    )
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("fault_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("handled_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["fault_id"], ["faults.id"], name=op.f("fk_events_fault_id_faults")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_fault_id"), ["fault_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_job"), ["job"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_node"), ["node"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_time"), ["time"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_type"), ["type"], unique=False)
        batch_op.create_index("ix_events_unhandled", ["handled_at"], unique=False)

    op.create_table(
        "actions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("idempotency_key", sa.String(length=200), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("job", sa.String(length=253), nullable=True),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("fault_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["event_id"], ["events.id"], name=op.f("fk_actions_event_id_events")
        ),
        sa.ForeignKeyConstraint(
            ["fault_id"], ["faults.id"], name=op.f("fk_actions_fault_id_faults")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_actions")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_actions_idempotency_key")),
    )
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_actions_event_id"), ["event_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_fault_id"), ["fault_id"], unique=False)
        batch_op.create_index(
            "ix_actions_job_type_created", ["job", "type", "created_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_actions_node"), ["node"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_type"), ["type"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_actions_type"))
        batch_op.drop_index(batch_op.f("ix_actions_status"))
        batch_op.drop_index(batch_op.f("ix_actions_node"))
        batch_op.drop_index("ix_actions_job_type_created")
        batch_op.drop_index(batch_op.f("ix_actions_fault_id"))
        batch_op.drop_index(batch_op.f("ix_actions_event_id"))

    op.drop_table("actions")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_unhandled")
        batch_op.drop_index(batch_op.f("ix_events_type"))
        batch_op.drop_index(batch_op.f("ix_events_time"))
        batch_op.drop_index(batch_op.f("ix_events_node"))
        batch_op.drop_index(batch_op.f("ix_events_job"))
        batch_op.drop_index(batch_op.f("ix_events_fault_id"))

    op.drop_table("events")
    op.drop_table("policy_counters")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_nodes_job"))

    op.drop_table("nodes")
    op.drop_table("jobs")
    op.drop_table("faults")
