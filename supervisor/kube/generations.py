"""Which generation of a JobSet's pods and Jobs a disruptive action was decided for, and
whether it was replaced since, so that an action never restarts a job twice.

With the failure policy of docs/kubernetes.md ("JobSet requirements"), a worker that crashes
fails its Job, and the JobSet controller restarts the whole JobSet by itself (its
`status.restarts` and the `restart-attempt` label of the new Jobs and pods go up by
one). The supervisor sees the same crash (the host monitor reports the worker exited)
and its policy asks for a restart too. Acted on blindly, that restart would evict the
new pods: a second, needless restart.

So each disruptive action is decided against the generation that existed at its
reference time: the earliest moment the failure its event reports can have happened
(`reference_time`). The generation then is the JobSet's `status.restarts` at that time,
as the watch saw it change, or the lowest `restart-attempt` of the pods and Jobs created
before it that still exist (the JobSet controller recreates each Job once its old one is
gone, so old and new ones do coexist while a restart is under way). If `status.restarts`
has gone past it, or the pods in scope were all created after the reference time, the
restart has been done already: the action is skipped. Where it is unclear (a restart
right around the failure), this errs towards skipping: a restart skipped wrongly is done
by the JobSet controller anyway, as the failure fails a Job; one done twice costs the
whole job a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from supervisor.domain import Event, EventType
from supervisor.event_details import HangDetails, HeartbeatSilenceDetails, details_of
from supervisor.kube import objects as o
from supervisor.kube.discovery import Discovery
from supervisor.kube.journal import Target, target_of
from supervisor.kube.objects import Obj
from supervisor.kube.worlds import current_world, healed_since


@dataclass(frozen=True, slots=True)
class Generation:
    """The JobSet's restart attempt at the reference time (None: unknown), and now."""

    at_event: int | None
    now: int

    @property
    def restarted(self) -> bool:
        """The JobSet controller restarted the JobSet after the reference time."""
        return self.at_event is not None and self.now > self.at_event

    @property
    def skipped(self) -> str:
        return f"already restarted by the JobSet controller (restart-attempt {self.now})"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an action should do: act on `targets`, or skip (the
    reason), or fail (the error). `wait`: a controller is replacing failed or
    terminating objects of that generation; look again once it has reacted."""

    generation: Generation
    targets: list[Target] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    wait: bool = False


#: Events a host monitor reports in a heartbeat: what they say happened at most one
#: heartbeat period before the supervisor heard of it.
IN_HEARTBEATS = frozenset(
    {EventType.WORKER_EXITED, EventType.WORKER_HEARTBEAT_LOST, EventType.GPU_XID, EventType.GPU_ECC}
)


def reference_time(event: Event, heartbeat_period_s: float) -> datetime:
    """The earliest moment the failure an event reports can have happened: the last
    heartbeat of a node whose heartbeats were lost; the start of a hang
    (`stalled_for_s`); one heartbeat period before the supervisor recorded an event a
    heartbeat carried; else when it was recorded."""
    details = details_of(event)
    last = details.last_heartbeat if isinstance(details, HeartbeatSilenceDetails) else None
    if last is not None:
        try:
            seen: datetime | None = datetime.fromisoformat(last)
        except ValueError:
            seen = None
        if seen is not None and seen.tzinfo is not None and seen < event.time:
            return seen
    back = heartbeat_period_s if event.type in IN_HEARTBEATS else 0.0
    stalled = details.stalled_for_s if isinstance(details, HangDetails) else None
    if stalled is not None:
        back = max(back, stalled)
    return event.time - timedelta(seconds=back)


def generation(discovery: Discovery, js: Obj, when: datetime) -> Generation:
    name = o.name_of(js)
    objects = [*discovery.pods_of(name), *discovery.child_jobs(name)]
    seen = [o.restart_attempt(x) for x in objects if not discovery.created_after(x, when)]
    if (restarts := discovery.restarts_at(js, when)) is not None:
        seen.append(restarts)
    return Generation(min(seen) if seen else None, o.jobset_restarts(js))


def pods_to_restart(discovery: Discovery, js: Obj, node: str | None, when: datetime) -> Verdict:
    """Restart in place: the running pods of the JobSet (on `node`) created before `when`."""
    name = o.name_of(js)
    gen = generation(discovery, js, when)
    where = f" on {node}" if node else ""
    if o.jobset_finished(js):
        return Verdict(gen, error=f"JobSet {name} has finished; it cannot be restarted")
    if gen.restarted:
        return Verdict(gen, skipped=gen.skipped)
    pods = discovery.pods_of(name)
    live = [
        p
        for p in pods
        if (node is None or o.node_of(p) == node) and not o.terminating(p) and not o.pod_finished(p)
    ]
    old = sorted(target_of(p) for p in live if not discovery.created_after(p, when))
    if old:
        return Verdict(gen, targets=old)
    if live:
        return Verdict(
            gen,
            skipped=f"already replaced: the pods of {name}{where} were created after the"
            f" event (restart-attempt {gen.now})",
        )
    error = f"no running pod of {name}{where}"
    # Failed or terminating pods, a failed Job: the Job or JobSet controller is on it.
    replacing = any(o.terminating(p) or o.pod_finished(p) for p in pods) or any(
        o.job_failed(j) for j in discovery.child_jobs(name)
    )
    return Verdict(gen, error=error, wait=replacing)


def jobs_to_restart(discovery: Discovery, js: Obj, when: datetime) -> Verdict:
    """Workload restart: the JobSet's child Jobs created before `when` (those already
    being deleted too: they are waited for like the others)."""
    name = o.name_of(js)
    gen = generation(discovery, js, when)
    if o.jobset_finished(js):
        return Verdict(gen, error=f"JobSet {name} has finished; it cannot be restarted")
    if gen.restarted:
        return Verdict(gen, skipped=gen.skipped)
    if o.in_process_enabled(js) and healed_since(js, when):
        world = current_world(js, []).attempt
        return Verdict(gen, skipped=f"healed in-process since the event (world {world})")
    jobs = discovery.child_jobs(name)
    old = [j for j in jobs if not discovery.created_after(j, when)]
    if not old and jobs:
        return Verdict(
            gen,
            skipped=f"already replaced: the Jobs of {name} were created after the event"
            f" (restart-attempt {gen.now})",
        )
    if not old:
        return Verdict(gen, error=f"JobSet {name} has no child Jobs to restart")
    # A failed Job: the JobSet controller is about to restart the JobSet (or fail it).
    failing = any(o.job_failed(j) and not o.terminating(j) for j in old)
    return Verdict(gen, targets=sorted(target_of(j) for j in old), wait=failing)
