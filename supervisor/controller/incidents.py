"""One incident, one remedy: the events a remedy's fault goes on raising are attached to
its incident instead of getting remedies of their own.

An incident opens when the policy decides a remedy for a job (an action that stops or
starts its workers, or the emergency checkpoint before it) and closes when the job's lane
has carried it out. An event of the same job is attached to it, recorded with no action
of its own, when

- it arrives while the remedy runs (its time is before the remedy finished): any worker
  event of the job (a worker that exited, went silent or hung, or a straggler), since a
  lock-step job's workers fail together, but the exit of a worker the remedy started
  (a pid it did not find there): a world that fails at once may do so before its
  remedy is recorded finished, and nothing else would come to say so; a node failure
  (a lost node, a GPU error) only on a node the incident already covers: any other
  node's failure gets its own remedy, after this one (the job's lane runs them in
  order);
- or it arrives within the detection lag after the remedy finished (`lag_s`: the
  heartbeat timeout plus a polling period) and is about a worker process that was there
  when the remedy was decided (same node, rank and pid): the old worker's end, seen late.
  A worker the remedy started that fails is a new failure, and escalates as usual.

A remedy that failed heals nothing: the failures seen while it ran are still there, and
nothing else may come to say so (every worker of the job may be gone). So no event is
attached to a failed incident: the next one goes to the policy, which sees the failed
remedy in its context and decides afresh; the events after it attach to that remedy.
Since a job's lane runs its work in order, the events that came while a remedy ran are
handled only once it finished, when whether it failed is known.

Kept per job, the newest incident only, in memory and in the store
(supervisor/store/remedy_state.py): written when it opens and when it closes, read back
when a supervisor starts acting, so that after a restart or a change of leader the
events its fault goes on raising still attach to it. A remedy left unfinished by the
last supervisor closes its incident when the new one has carried it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    NODE_FAILURE_EVENTS,
    ActionRecord,
    ActionStatus,
    Event,
    EventType,
    NodeView,
    utcnow,
)
from supervisor.event_details import WorkerExitedDetails, details_of
from supervisor.remedies import REMEDIES
from supervisor.store import IncidentRecord

#: Events about the job's workers: during a remedy, they are its effects or its cause.
WORKER_EVENTS = frozenset(
    {
        EventType.WORKER_EXITED,
        EventType.WORKER_HEARTBEAT_LOST,
        EventType.HANG,
        EventType.STRAGGLER,
    }
)


@dataclass(slots=True)
class Incident:
    job: str
    #: The event the remedy was decided for.
    trigger_id: int | None
    #: The action the attached events are listed on: the (last) one that heals.
    action_id: int
    nodes: frozenset[str]
    #: (node, rank, pid) of the job's workers when the remedy was decided.
    workers: frozenset[tuple[str, int, int]]
    opened_at: datetime
    finished_at: datetime | None = None
    failed: bool = False

    def record(self) -> IncidentRecord:
        return IncidentRecord(
            self.trigger_id,
            self.action_id,
            self.nodes,
            self.workers,
            self.opened_at,
            self.finished_at,
            self.failed,
        )


class Incidents:
    """The newest incident of each job, which incident an event belongs to, and which
    jobs' incidents changed since they were last kept in the store."""

    def __init__(self, lag_s: float) -> None:
        self.lag = timedelta(seconds=lag_s)
        self._newest: dict[str, Incident] = {}
        self._changed: set[str] = set()

    def restore(self, records: dict[str, IncidentRecord]) -> None:
        """The incidents a previous supervisor kept in the store."""
        for job, r in records.items():
            self._newest[job] = Incident(
                job,
                r.trigger_event,
                r.action_id,
                r.nodes,
                r.workers,
                r.opened_at,
                r.finished_at,
                r.failed,
            )

    def changed(self) -> dict[str, IncidentRecord]:
        """The incidents changed since they were last kept, as they stand now."""
        return {job: self._newest[job].record() for job in self._changed if job in self._newest}

    def kept(self, job: str, record: IncidentRecord) -> None:
        """`record` of the job is in the store (unless its incident changed since)."""
        incident = self._newest.get(job)
        if incident is None or incident.record() == record:
            self._changed.discard(job)

    def opened(
        self, event: Event, actions: list[ActionRecord], nodes: dict[str, NodeView]
    ) -> Incident | None:
        """The policy decided `actions` for `event`: the incident they open, if they heal."""
        remedies = [a for a in actions if a.type in REMEDIES and a.job is not None]
        if not remedies:
            return None
        job = remedies[0].job
        assert job is not None
        main = next((a for a in reversed(remedies) if a.type in DISRUPTIVE_ACTIONS), remedies[0])
        covered = {a.node for a in remedies if a.node}
        if event.node:
            covered.add(event.node)
        workers = frozenset(
            (view.name, w.rank, w.pid)
            for view in nodes.values()
            if view.job == job
            for w in view.workers
            if w.pid is not None
        )
        incident = Incident(job, event.id, main.id, frozenset(covered), workers, utcnow())
        self._newest[job] = incident
        self._changed.add(job)
        return incident

    def closed(self, incident: Incident, *, failed: bool) -> None:
        """Its remedy was carried out; `failed`: its healing action failed."""
        incident.finished_at = utcnow()
        incident.failed = failed
        self._changed.add(incident.job)

    def carried_out(self, action: ActionRecord) -> None:
        """`action`, resumed from the store, ran to its end: the incident it heals (one a
        previous supervisor opened) is closed."""
        incident = self._newest.get(action.job or "")
        if incident is None or incident.action_id != action.id or incident.finished_at:
            return
        if action.status.finished:
            self.closed(incident, failed=action.status is ActionStatus.FAILED)

    def incident_of(self, event: Event) -> Incident | None:
        """The incident `event` belongs to, if any (see the module docstring)."""
        if event.job is None:
            return None
        incident = self._newest.get(event.job)
        if incident is None or incident.trigger_id == event.id or incident.failed:
            return None
        if event.type is EventType.WORKER_EXITED and WorkerExitedDetails.of(event).exit_code == 0:
            return None  # a worker that finished: no failure
        done = incident.finished_at
        if done is None or event.time <= done:
            if event.type in WORKER_EVENTS:
                return None if _started_by_the_remedy(incident, event) else incident
            if event.type in NODE_FAILURE_EVENTS and event.node in incident.nodes:
                return incident
            return None
        if event.time > done + self.lag or event.type not in WORKER_EVENTS:
            return None
        return incident if _worker_of(event) in incident.workers else None


def _worker_of(event: Event) -> tuple[str, int, int] | None:
    """(node, rank, pid) of the worker `event` is about; None when it does not say."""
    pid = getattr(details_of(event), "pid", None)
    if event.node is None or event.rank is None or pid is None:
        return None
    return (event.node, event.rank, pid)


def _started_by_the_remedy(incident: Incident, event: Event) -> bool:
    """`event` is the exit of a worker the incident did not know (another pid on that
    node and rank, or a node it had no worker on): one its remedy started. A worker the
    remedy stopped says `stopped`, not `exited`, so this exit is the new world's own."""
    if event.type is not EventType.WORKER_EXITED or not incident.workers:
        return False
    worker = _worker_of(event)
    return worker is not None and worker not in incident.workers
