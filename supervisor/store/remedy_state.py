"""What the controller remembers of each job, kept so that a supervisor restarted, or one
newly elected leader, goes on where the last one stopped: the job's restart budget
(remedies without progress, whether it was given up, an operator's reset) and its newest
incident (the remedy it started, what it covers). Each write is one short transaction,
an upsert of the job's row, made when the state changes (never per heartbeat), refused
when a newer leader (a higher epoch, supervisor/store/epochs.py) wrote the row; a live
supervisor's rows and a dry-run one's are kept apart (their scope) and never read by
the other."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from supervisor.domain import utcnow
from supervisor.store.base import RepositoryBase
from supervisor.store.models import JobBudgetRow, JobIncidentRow


@dataclass(frozen=True, slots=True)
class BudgetRecord:
    """A job's restart budget (supervisor/controller/budget.py)."""

    no_progress: int = 0
    #: Every rank's step when the last remedy was decided; None: progress seen since.
    stood_at: int | None = None
    #: The last event whose remedy was counted.
    counted_event: int | None = None
    given_up: str | None = None
    reset_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class IncidentRecord:
    """A job's newest incident (supervisor/controller/incidents.py)."""

    trigger_event: int | None
    action_id: int
    nodes: frozenset[str]
    workers: frozenset[tuple[str, int, int]]
    opened_at: datetime
    finished_at: datetime | None = None
    failed: bool = False


def _older(row: JobBudgetRow | JobIncidentRow, epoch: int | None) -> bool:
    """Whether `row` was written by a newer leader than the supervisor of `epoch`."""
    return epoch is not None and row.leader_epoch is not None and row.leader_epoch > epoch


class RemedyStateRecords(RepositoryBase):
    def save_budget(self, job: str, budget: BudgetRecord, *, epoch: int | None) -> bool:
        """Keep the job's budget, written by the supervisor of leader `epoch` (None: one
        that takes none, a dry run); False, changing nothing, when a newer leader wrote
        it: an older leader's write never wins."""
        with self._sessions.begin() as session:
            row = session.get(JobBudgetRow, (self._job_scope, job), with_for_update=True)
            if row is None:
                row = JobBudgetRow(scope=self._job_scope, job=job)
                session.add(row)
            elif _older(row, epoch):
                return False
            row.no_progress = budget.no_progress
            row.stood_at = budget.stood_at
            row.counted_event = budget.counted_event
            row.given_up = budget.given_up
            row.reset_at = budget.reset_at
            row.leader_epoch = epoch
            row.updated_at = utcnow()
        return True

    def save_incident(self, job: str, incident: IncidentRecord, *, epoch: int | None) -> bool:
        """Keep the job's newest incident, as `save_budget` keeps its budget."""
        with self._sessions.begin() as session:
            row = session.get(JobIncidentRow, (self._job_scope, job), with_for_update=True)
            if row is None:
                row = JobIncidentRow(scope=self._job_scope, job=job)
                session.add(row)
            elif _older(row, epoch):
                return False
            row.trigger_event = incident.trigger_event
            row.action_id = incident.action_id
            row.nodes = sorted(incident.nodes)
            row.workers = [list(w) for w in sorted(incident.workers)]
            row.opened_at = incident.opened_at
            row.finished_at = incident.finished_at
            row.failed = incident.failed
            row.leader_epoch = epoch
        return True

    def load_budgets(self) -> dict[str, BudgetRecord]:
        with self._sessions() as session:
            rows = session.scalars(
                select(JobBudgetRow).where(JobBudgetRow.scope == self._job_scope)
            ).all()
        return {
            r.job: BudgetRecord(r.no_progress, r.stood_at, r.counted_event, r.given_up, r.reset_at)
            for r in rows
        }

    def load_incidents(self) -> dict[str, IncidentRecord]:
        with self._sessions() as session:
            rows = session.scalars(
                select(JobIncidentRow).where(JobIncidentRow.scope == self._job_scope)
            ).all()
        return {
            r.job: IncidentRecord(
                trigger_event=r.trigger_event,
                action_id=r.action_id,
                nodes=frozenset(r.nodes),
                workers=frozenset((str(n), int(rank), int(pid)) for n, rank, pid in r.workers),
                opened_at=r.opened_at,
                finished_at=r.finished_at,
                failed=r.failed,
            )
            for r in rows
        }
