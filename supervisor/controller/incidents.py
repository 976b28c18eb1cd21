"""One incident, one remedy: the events a remedy's fault goes on raising are attached to
its incident instead of getting remedies of their own.

An incident opens when the policy decides a remedy for a job (an action that stops or
starts its workers, or the emergency checkpoint before it) and closes when the job's lane
has carried it out. An event of the same job is attached to it, recorded with no action
of its own, when

- it arrives while the remedy runs (its time is before the remedy finished): any worker
  event of the job (a worker that exited, went silent or hung, or a straggler), since a
  lock-step job's workers fail together; a node failure (a lost node, a GPU error) only
  on a node the incident already covers: any other node's failure gets its own remedy,
  after this one (the job's lane runs them in order);
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

Kept in memory, per job, the newest incident only; after a restart of the supervisor the
events left unhandled go to the policy as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    NODE_FAILURE_EVENTS,
    ActionRecord,
    Event,
    EventType,
    NodeView,
    utcnow,
)
from supervisor.event_details import WorkerExitedDetails, details_of
from supervisor.remedies import REMEDIES

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
    trigger: Event
    #: The action the attached events are listed on: the (last) one that heals.
    action_id: int
    nodes: frozenset[str]
    #: (node, rank, pid) of the job's workers when the remedy was decided.
    workers: frozenset[tuple[str, int, int]]
    finished_at: datetime | None = None
    failed: bool = False


class Incidents:
    """The newest incident of each job, and which incident an event belongs to."""

    def __init__(self, lag_s: float) -> None:
        self.lag = timedelta(seconds=lag_s)
        self._newest: dict[str, Incident] = {}

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
        incident = Incident(job, event, main.id, frozenset(covered), workers)
        self._newest[job] = incident
        return incident

    def closed(self, incident: Incident, *, failed: bool) -> None:
        """Its remedy was carried out; `failed`: its healing action failed."""
        incident.finished_at = utcnow()
        incident.failed = failed

    def incident_of(self, event: Event) -> Incident | None:
        """The incident `event` belongs to, if any (see the module docstring)."""
        if event.job is None:
            return None
        incident = self._newest.get(event.job)
        if incident is None or incident.trigger.id == event.id or incident.failed:
            return None
        if event.type is EventType.WORKER_EXITED and WorkerExitedDetails.of(event).exit_code == 0:
            return None  # a worker that finished: no failure
        done = incident.finished_at
        if done is None or event.time <= done:
            if event.type in WORKER_EVENTS:
                return incident
            if event.type in NODE_FAILURE_EVENTS and event.node in incident.nodes:
                return incident
            return None
        if event.time > done + self.lag or event.type not in WORKER_EVENTS:
            return None
        pid = getattr(details_of(event), "pid", None)
        if event.node is None or event.rank is None or pid is None:
            return None
        return incident if (event.node, event.rank, pid) in incident.workers else None
