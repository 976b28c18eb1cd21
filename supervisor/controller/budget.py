"""A job's restart budget, judged by progress, and the supervisor's word when it is spent.

Each remedy the policy decides for a job (an action that stops or starts its workers) is
counted until the job makes progress after it: every rank past the step it stood at when
the remedy was decided (the step its emergency checkpoint restores). A job whose last
`max_no_progress_restarts` remedies were not followed by progress, or that took
`max_restarts_in_window` disruptive actions in the window (the safety net), is judged
unhealable: the policy sees the counts (`PolicyContext.no_progress_restarts`), and when
a failure of the job then gets no remedy the supervisor gives up on it, once, and says
so (a `job_given_up` event with the reason; the job's state `given_up`; the metric
`supervisor_jobs_given_up`). An operator starts the job's budget over
(`supervisor reset-budget JOB`: a `job_budget_reset` event; the window count then counts
only actions after it).

Kept in the store as well (supervisor/store/remedy_state.py), written when a job's budget
changes and read back when a supervisor starts acting: a restarted supervisor, or a new
leader, goes on counting where the last one stopped, and a job given up stays given up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    NODE_FAILURE_EVENTS,
    ActionRecord,
    Event,
    EventType,
    JobView,
    NodeView,
    WorkerState,
    utcnow,
)
from supervisor.event_details import (
    JobBudgetResetDetails,
    JobGivenUpDetails,
    WorkerExitedDetails,
)
from supervisor.policy import PolicyContext
from supervisor.store import BudgetRecord

#: Events that say a job is failing: when one gets no remedy for a spent budget, the
#: supervisor gives up on the job.
_FAILING = NODE_FAILURE_EVENTS | {
    EventType.WORKER_HEARTBEAT_LOST,
    EventType.HANG,
    EventType.WORKLOAD_DOWN,
}
_AT_WORK = frozenset({WorkerState.RUNNING, WorkerState.FINISHING})
#: The exit code of a usage error (argparse's, a shell's): bad arguments or settings, which
#: no restart mends.
USAGE_ERROR = 2


def is_failing(event: Event) -> bool:
    if event.type is EventType.WORKER_EXITED:
        return WorkerExitedDetails.of(event).exit_code != 0
    return event.type in _FAILING


def usage_error(event: Event, context: PolicyContext) -> str | None:
    """Why `event` is a failure no restart mends, or None: a worker that exited with a
    usage error before its job reported any step (a job that reports none: at any time).
    Such an event gets no remedy, whatever the policy, and its job is given up."""
    if event.type is not EventType.WORKER_EXITED or event.job is None:
        return None
    details = WorkerExitedDetails.of(event)
    view = context.job(event.job)
    if details.exit_code != USAGE_ERROR or details.step is not None:
        return None
    if view is not None and view.last_step is not None:
        return None
    return (
        f"rank {event.rank} on {event.node} exited with code {USAGE_ERROR} (a usage error: "
        "bad arguments or settings) before the job's first step: not restarted"
    )


def every_rank_step(
    nodes: Mapping[str, NodeView], job: str, jobs: Mapping[str, JobView] | None = None
) -> int | None:
    """The step every rank of the job at work has passed (their lowest); where no worker
    reports its step (a backend that sees only the job's), the job's newest step."""
    steps = [
        w.step
        for view in nodes.values()
        if view.job == job and view.alive
        for w in view.workers
        if w.state in _AT_WORK and w.step is not None
    ]
    if steps:
        return min(steps)
    view = jobs.get(job) if jobs is not None else None
    return view.last_step if view is not None else None


@dataclass(slots=True)
class _Budget:
    no_progress: int = 0
    #: Every rank's step when the last remedy was decided; None: progress seen since.
    stood_at: int | None = None
    #: The last event whose remedy was counted: a decision handled again (the database
    #: was unavailable meanwhile) counts once.
    counted_event: int | None = None
    given_up: str | None = None
    reset_at: datetime | None = None

    def record(self) -> BudgetRecord:
        return BudgetRecord(
            self.no_progress, self.stood_at, self.counted_event, self.given_up, self.reset_at
        )


class Budgets:
    """Every job's count of remedies without progress, and whether it was given up; which
    jobs' budgets changed since they were last kept in the store."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Budget] = {}
        self._changed: set[str] = set()
        #: `job_given_up` events to raise once the give-up is kept in the store.
        self._unsaid: dict[str, Event] = {}

    def restore(self, records: Mapping[str, BudgetRecord]) -> None:
        """The budgets a previous supervisor kept in the store."""
        for job, r in records.items():
            self._jobs[job] = _Budget(
                r.no_progress, r.stood_at, r.counted_event, r.given_up, r.reset_at
            )

    def changed(self) -> dict[str, BudgetRecord]:
        """The budgets changed since they were last kept, as they stand now."""
        return {job: self._jobs[job].record() for job in self._changed if job in self._jobs}

    def kept(self, job: str, record: BudgetRecord) -> None:
        """`record` of the job is in the store (unless the job changed since)."""
        budget = self._jobs.get(job)
        if budget is None or budget.record() == record:
            self._changed.discard(job)

    def unsaid(self) -> list[Event]:
        """The `job_given_up` events whose give-up is kept now: to raise, once each."""
        events = [e for job, e in self._unsaid.items() if job not in self._changed]
        for event in events:
            assert event.job is not None
            del self._unsaid[event.job]
        return events

    def observe(self, job: str, nodes: Mapping[str, NodeView], jobs: Mapping[str, JobView]) -> None:
        """Before a decision: has the job progressed since its last remedy?"""
        budget = self._jobs.get(job)
        if budget is None or budget.stood_at is None:
            return
        step = every_rank_step(nodes, job, jobs)
        if step is not None and step > budget.stood_at:
            budget.no_progress = 0
            budget.stood_at = None
            self._changed.add(job)

    def remedied(
        self,
        event: Event,
        actions: list[ActionRecord],
        nodes: Mapping[str, NodeView],
        jobs: Mapping[str, JobView],
    ) -> None:
        """The policy decided `actions` for `event`, of its job: a remedy counts until
        progress."""
        job = event.job
        if job is None or not any(a.type in DISRUPTIVE_ACTIONS for a in actions):
            return
        budget = self._jobs.setdefault(job, _Budget())
        if event.id is not None and budget.counted_event == event.id:
            return  # the same decision, handled again
        budget.no_progress += 1
        budget.counted_event = event.id
        step = every_rank_step(nodes, job, jobs)
        budget.stood_at = -1 if step is None else step
        self._changed.add(job)

    def counts(self) -> dict[str, int]:
        return {job: b.no_progress for job, b in self._jobs.items() if b.no_progress}

    def reset_times(self) -> dict[str, datetime]:
        return {job: b.reset_at for job, b in self._jobs.items() if b.reset_at is not None}

    def given_up(self, job: str) -> str | None:
        """Why the supervisor gave up on the job; None while it has not."""
        budget = self._jobs.get(job)
        return budget.given_up if budget is not None else None

    @property
    def given_up_count(self) -> int:
        return sum(1 for b in self._jobs.values() if b.given_up is not None)

    def give_up(
        self, event: Event, context: PolicyContext, unmendable: str | None = None
    ) -> Event | None:
        """`event`, a failure of its job, got no remedy: the `job_given_up` event when the
        job's budget is spent, or the failure is `unmendable` (why), and it was not given
        up already. It is raised once the give-up is kept in the store (`unsaid`)."""
        job = event.job
        if job is None or not is_failing(event):
            return None
        limits = context.limits
        no_progress = context.restarts_without_progress(job)
        in_window = context.recent_restarts(job)
        if unmendable is not None:
            reason = unmendable
        elif no_progress >= limits.max_no_progress_restarts:
            reason = (
                f"{no_progress} remedies in a row were not followed by progress "
                f"(max_no_progress_restarts={limits.max_no_progress_restarts})"
            )
        elif in_window >= limits.max_restarts_in_window:
            reason = (
                f"{in_window} disruptive actions within {limits.restart_window_s:g}s "
                f"(max_restarts_in_window={limits.max_restarts_in_window})"
            )
        else:
            return None
        budget = self._jobs.setdefault(job, _Budget())
        if budget.given_up is not None:
            return None
        view = context.job(job)
        if unmendable is None:
            reason += f"; last failure: {event.type.value}" + (
                f" on {event.node}" if event.node else ""
            )
        budget.given_up = reason
        self._changed.add(job)
        given_up = Event(
            type=EventType.JOB_GIVEN_UP,
            time=utcnow(),
            job=job,
            details=JobGivenUpDetails(
                reason=reason,
                no_progress_restarts=no_progress,
                restarts_in_window=in_window,
                last_step=view.last_step if view is not None else None,
            ).mapping(),
        )
        self._unsaid[job] = given_up
        return given_up

    def reset(self, job: str, kept: BudgetRecord) -> Event:
        """An operator started the job's budget over, `kept` in the store (a fresh budget
        with its reset time): the `job_budget_reset` event to record."""
        before = self._jobs.get(job, _Budget())
        self._jobs[job] = _Budget(reset_at=kept.reset_at)
        self._changed.discard(job)
        self._unsaid.pop(job, None)  # a give-up not said yet: no longer so
        return Event(
            type=EventType.JOB_BUDGET_RESET,
            time=utcnow(),
            job=job,
            details=JobBudgetResetDetails(
                was_given_up=before.given_up is not None,
                no_progress_restarts=before.no_progress,
            ).mapping(),
        )
