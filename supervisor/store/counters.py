"""The counters the policy reads (node failures, actions per job), kept across restarts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select

from supervisor.domain import (
    RESTART_ACTIONS,
    ActionStatus,
    ActionType,
)
from supervisor.store.base import FAILURES, NODE_SCOPE, RepositoryBase
from supervisor.store.models import (
    ActionRow,
    CounterRow,
)


@dataclass(frozen=True, slots=True)
class PolicyCounts:
    node_failures: dict[str, int]
    action_counts: dict[tuple[str, ActionType], int]
    restarts_in_window: dict[str, int]
    #: Jobs whose latest disruptive action failed: nothing of them may be running.
    failed_last_remedy: frozenset[str] = frozenset()


class PolicyCounters(RepositoryBase):
    # --- policy counters --------------------------------------------------------------

    def policy_counts(self, window_start: datetime) -> PolicyCounts:
        restart_types = [t.value for t in RESTART_ACTIONS]
        with self._sessions() as session:
            counters = list(session.scalars(select(CounterRow)))
            recent = session.execute(
                select(ActionRow.job, func.count())
                .where(ActionRow.type.in_(restart_types))
                .where(ActionRow.created_at >= window_start)
                .where(ActionRow.job.is_not(None))
                .where(ActionRow.dry_run == self.dry_run)
                .group_by(ActionRow.job)
            ).all()
            latest = (
                select(func.max(ActionRow.id).label("id"))
                .where(ActionRow.type.in_(restart_types))
                .where(ActionRow.job.is_not(None))
                .where(ActionRow.dry_run == self.dry_run)
                .group_by(ActionRow.job)
                .subquery()
            )
            failed_last = session.scalars(
                select(ActionRow.job)
                .join(latest, ActionRow.id == latest.c.id)
                .where(ActionRow.status == ActionStatus.FAILED.value)
            ).all()
        node_failures = {
            c.key: c.value for c in counters if c.scope == NODE_SCOPE and c.name == FAILURES
        }
        action_counts = {
            (c.key, ActionType(c.name)): c.value
            for c in counters
            if c.scope == self._job_scope and c.name in ActionType.__members__.values()
        }
        return PolicyCounts(
            node_failures=node_failures,
            action_counts=action_counts,
            restarts_in_window={job: count for job, count in recent if job},
            failed_last_remedy=frozenset(job for job in failed_last if job),
        )
