"""The cluster's picture as the sensor hands it over: nodes, jobs, the events that
changed them (with the node failure counters), and the picture read back at start."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.domain import (
    NODE_FAILURE_EVENTS,
    Event,
    JobView,
    NodeView,
    utcnow,
)
from supervisor.store.base import FAILURES, NODE_SCOPE, RepositoryBase
from supervisor.store.mappers import (
    event_of,
    job_of,
    node_of,
)
from supervisor.store.models import (
    EventRow,
    JobRow,
    NodeRow,
)
from supervisor.store.upsert import upsert
from supervisor.xid import blames_node


class ClusterPictureRecords(RepositoryBase):
    # --- sensor output ----------------------------------------------------------------

    def record(
        self,
        events: Sequence[Event],
        nodes: Sequence[NodeView] = (),
        jobs: Sequence[JobView] = (),
    ) -> list[Event]:
        """Persist new events and changed nodes and jobs; return the events with ids.

        A node failure also bumps the node's failure counter in the same transaction, so
        the count the policy sees is exactly the number of failures recorded.
        """
        now = utcnow()
        with self._sessions.begin() as session:
            for job in jobs:
                self._upsert_job(session, job, now)
            for node in nodes:
                self._upsert_node(session, node, now)
            rows = [
                EventRow(
                    type=e.type.value,
                    time=e.time,
                    node=e.node,
                    job=e.job,
                    rank=e.rank,
                    details=dict(e.details),
                    fault_id=e.fault_id,
                )
                for e in events
            ]
            session.add_all(rows)
            session.flush()
            for event in events:
                # An XID of the application's own is not the node's failure.
                if event.node and event.type in NODE_FAILURE_EVENTS and blames_node(event):
                    self._bump(session, NODE_SCOPE, event.node, FAILURES, now)
            return [event_of(row) for row in rows]

    def _upsert_node(self, session: Session, node: NodeView, now: datetime) -> None:
        values = {
            "name": node.name,
            "state": node.state.value,
            "job": node.job,
            "alive": node.alive,
            "cordoned": node.cordoned,
            "flapping": node.flapping,
            "last_heartbeat": node.last_heartbeat,
            "workers": [
                {
                    "rank": w.rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state.value,
                    "step": w.step,
                    "exit_code": w.exit_code,
                }
                for w in node.workers
            ],
            "updated_at": now,
        }
        upsert(session, NodeRow, values, ("name",))

    def _upsert_job(self, session: Session, job: JobView, now: datetime) -> None:
        values = {
            "name": job.name,
            "num_dp_replicas": job.num_dp_replicas,
            "min_num_dp_replicas": job.min_num_dp_replicas,
            "max_num_dp_replicas": job.max_num_dp_replicas,
            "num_nodes_per_dp": job.num_nodes_per_dp,
            "step_interval_s": job.step_interval_s,
            "updated_at": now,
        }
        # `created_at` only when the row is new: every other value, always.
        upsert(session, JobRow, {**values, "created_at": now}, ("name",), keep=("created_at",))

    def load_nodes(self) -> list[NodeView]:
        with self._sessions() as session:
            return [node_of(r) for r in session.scalars(select(NodeRow).order_by(NodeRow.name))]

    def load_jobs(self) -> list[JobView]:
        with self._sessions() as session:
            return [job_of(r) for r in session.scalars(select(JobRow).order_by(JobRow.name))]
