"""The sensor: keeps the live picture of every node in memory and turns changes into events.

A heartbeat only updates memory and moves a deadline. Events come from state changes
(a worker exits, a GPU error is reported, a node comes back) and from deadlines passing
(a node goes silent, a job stops making progress). The caller persists what
`ingest` returns before acknowledging; timer-driven changes go to the `emit` callback.

The node and job records (`NodeRecord`, `JobRecord`) are the sensor's own: the rest of
the supervisor reads them through its read methods (views, names, a few facts), never
the records themselves. What the sensor does is in this module; the parts it uses are
beside it in the package:

- `deadlines.py`: the timers (a node's loss, a job's hang, the straggler check);
- `progress.py`: a job's step progress and the hang timeout learned from it;
- `stragglers.py`: which ranks compute slower than their peers, and for how long;
- `fault_marks.py`: what fault injection (`supervisor.faults`) tells the sensor: which
  nodes' heartbeats a fault mutes, and which fault a node's failures are due to.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from resiliency_protocol.heartbeat import (
    GpuReport,
    HostHeartbeat,
    WorkerReport,
    check_heartbeat,
    parse_heartbeat,
)
from supervisor.config_parts import SensingSettings, WorkloadSettings
from supervisor.domain import (
    Event,
    EventType,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
    WorkerView,
    utcnow,
    wall_time,
)
from supervisor.errors import SupervisorError
from supervisor.event_details import EVENT_DETAILS, HangDetails
from supervisor.metrics import Metrics
from supervisor.sensor.deadlines import DeadlineQueue
from supervisor.sensor.fault_marks import FaultMarks
from supervisor.sensor.finishing import SensedPhase, ends_the_loop, phase, stuck
from supervisor.sensor.progress import HangParams, JobProgress
from supervisor.sensor.stragglers import StragglerParams, StragglerScorer
from supervisor.xid import HEALTH, classify

NODE = "node"
HANG = "hang"
FINISHING = "finishing"  # a job's end, bounded by finishing_timeout_s
STRAGGLERS = "stragglers"  # the periodic straggler check (one key, name "")
WALL_OFFSET_TOLERANCE_S = 0.001
DeadlineKey = tuple[str, str]


@dataclass(slots=True)
class Changes:
    """What a sensor step produced: events to raise and records to persist."""

    events: list[Event] = field(default_factory=list)
    nodes: list[NodeView] = field(default_factory=list)
    jobs: list[JobView] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.nodes or self.jobs)

    @staticmethod
    def merged(batch: Iterable[Changes]) -> Changes:
        """Several steps' changes as one, in order: every event, and each node's and job's
        latest record."""
        out = Changes()
        nodes: dict[str, NodeView] = {}
        jobs: dict[str, JobView] = {}
        for changes in batch:
            out.events.extend(changes.events)
            for node in changes.nodes:
                nodes.pop(node.name, None)  # re-insert: the order of the latest records
                nodes[node.name] = node
            for job in changes.jobs:
                jobs.pop(job.name, None)
                jobs[job.name] = job
        out.nodes, out.jobs = list(nodes.values()), list(jobs.values())
        return out


#: What `Sensor.ingest` returns for a heartbeat that changed nothing. Shared: never add to it.
UNCHANGED = Changes()


class RankClaimed(SupervisorError):
    """A heartbeat's worker claims a rank of its job that another alive node reports
    running or starting: two nodes cannot run one rank at once. `index` is the worker's
    position in the heartbeat."""

    def __init__(self, job: str, rank: int, holder: str, index: int) -> None:
        super().__init__(
            f"workers.{index}.rank: rank {rank} of job {job} is running on node {holder}"
        )
        self.job = job
        self.rank = rank
        self.holder = holder
        self.index = index


@dataclass(slots=True)
class NodeRecord:
    # The fields a steady heartbeat reads and writes come first: slots are laid out in
    # this order, so they share two cache lines (at 10,000 nodes a node's record is
    # rarely still in cache when its next heartbeat comes).
    name: str
    state: NodeState
    job: str | None
    # Event-loop time of the last heartbeat (of the last restart, for a restored node that
    # has not reported since): the node's loss is due `heartbeat_timeout_s` after it.
    last_seen: float
    alive: bool = True
    flapping: bool = False
    # Ranks and states of `workers`, compared with each heartbeat's (`ingest`'s fast path);
    # None: not computed yet. A str and a tuple of ints: objects the cyclic GC skips.
    ranks: tuple[int, ...] | None = None
    states: str = ""
    all_running: bool = False  # every worker in `workers` is running
    # The workers as last reported: `reports`, unless `body` holds a newer heartbeat.
    reports: list[WorkerReport] = field(default_factory=list)
    # The latest steady heartbeat as the bytes it came in, decoded only when read: one
    # object kept per node instead of its ~33 parsed ones (8 reports and their ints),
    # which were freed cold in the CPU's caches at the node's next heartbeat; that
    # freeing cost 2.9 us of the server's ~31 us per heartbeat (bench/README.md).
    body: bytes | None = None
    address: str | None = None
    topology: dict[str, str] = field(default_factory=dict)
    # Unix time of the last heartbeat while `last_seen` cannot tell it (restored node).
    restored_wall: float | None = None
    cordoned: bool = False
    up_since: float = 0.0
    losses: list[float] = field(default_factory=list)
    ecc_counts: dict[int | None, int] | None = None
    gpu_seen: dict[tuple[str, int | None, int | None], float] | None = None
    deadline_key: DeadlineKey = ("", "")  # (NODE, name), built once
    # The workers' views as last built, and the reports they were built from: a policy's
    # snapshot of thousands of nodes rebuilds only those whose workers changed.
    worker_views: tuple[WorkerView, ...] = ()
    views_of: list[WorkerReport] | None = None

    def __post_init__(self) -> None:
        self.deadline_key = (NODE, self.name)

    @property
    def workers(self) -> list[WorkerReport]:
        """The workers as last reported."""
        if self.body is not None:  # validated when it came in: it decodes
            self.reports = parse_heartbeat(self.body).workers
            self.body = None
        return self.reports

    @workers.setter
    def workers(self, reports: list[WorkerReport]) -> None:
        self.reports = reports
        self.body = None

    def last_heartbeat(self, wall_offset: float) -> float:
        """Unix time of the last heartbeat; `wall_offset`: Unix time minus loop time."""
        if self.restored_wall is not None:
            return self.restored_wall
        return self.last_seen + wall_offset

    def view(self, wall_offset: float) -> NodeView:
        return NodeView(
            name=self.name,
            state=self.state,
            job=self.job,
            alive=self.alive,
            last_heartbeat=datetime.fromtimestamp(self.last_heartbeat(wall_offset), UTC),
            workers=self._worker_views(),
            cordoned=self.cordoned,
            flapping=self.flapping,
        )

    def _worker_views(self) -> tuple[WorkerView, ...]:
        reports = self.workers
        if reports is not self.views_of:
            self.worker_views = tuple(
                WorkerView(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    state=w.state,
                    step=w.step,
                    exit_code=w.exit_code,
                    compute_s=w.compute_s,
                )
                for w in reports
            )
            self.views_of = reports
        return self.worker_views


@dataclass(slots=True)
class JobRecord:
    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    progress: JobProgress
    nodes: set[str] = field(default_factory=set)
    hang_reported: bool = False
    #: When its first worker left the loop (finishing.py); None while it runs.
    finishing_since: float | None = None
    # rank -> the node whose last accepted heartbeat has it running or starting. A rank
    # moves to another node only once its holder stopped reporting it, or is not alive.
    claims: dict[int, str] = field(default_factory=dict)

    def view(self) -> JobView:
        return JobView(
            name=self.name,
            num_dp_replicas=self.num_dp_replicas,
            min_num_dp_replicas=self.min_num_dp_replicas,
            max_num_dp_replicas=self.max_num_dp_replicas,
            num_nodes_per_dp=self.num_nodes_per_dp,
            nodes=tuple(sorted(self.nodes)),
            last_step=self.progress.max_step if self.progress.max_step >= 0 else None,
            step_interval_s=self.progress.learned_interval_s,
        )


class Sensor:
    """Heartbeats, silence and timers in; events, and node and job records to persist, out.

    Inputs: `ingest` (a heartbeat), `restore` (the persisted picture, at start-up), and
    what the supervisor tells of its own actions (`set_cordoned`, `job_restarted`,
    `set_replicas`). Faults injected in the sensor: a GPU error (`inject_gpu_report`), and
    `fault_marks` (muted heartbeats, expected failures), which fault injection writes.
    Reads: the "reads" section below.
    """

    def __init__(
        self,
        settings: SensingSettings,
        workload: WorkloadSettings,
        emit: Callable[[Changes], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        #: A job's shape until its heartbeats or the store say otherwise.
        self.workload = workload
        self._emit = emit
        self.metrics = metrics or Metrics()
        self._nodes: dict[str, NodeRecord] = {}
        self._jobs: dict[str, JobRecord] = {}
        self._deadlines: DeadlineQueue[DeadlineKey] = DeadlineQueue(
            self._expired, extended=self._extended
        )
        #: Injected faults' marks: muted nodes, and the faults failures are attributed to
        #: (fault injection writes them, see `supervisor.faults`; the sensor reads them).
        self.fault_marks = FaultMarks(self._deadlines.time)
        self._timeout_s = settings.heartbeat_timeout_s
        # The event loop's clock, bound on first use (the loop may not exist yet).
        self._clock: Callable[[], float] = self._bind_clock
        self._offset = 0.0  # see _wall_offset
        self._hang = HangParams(
            fixed_timeout_s=settings.hang_timeout_s,
            min_timeout_s=settings.hang_min_timeout_s,
            safety_factor=settings.hang_safety_factor,
            warmup_intervals=settings.hang_warmup_intervals,
        )
        self.stragglers = StragglerScorer(
            StragglerParams(settings.straggler_threshold, settings.straggler_window_s)
        )
        # Counted when scraped: cheaper than keeping counts right on every transition.
        self.metrics.nodes.labels("true").set_function(
            lambda: sum(1 for n in self._nodes.values() if n.alive)
        )
        self.metrics.nodes.labels("false").set_function(
            lambda: sum(1 for n in self._nodes.values() if not n.alive)
        )

    def close(self) -> None:
        self._deadlines.close()

    def _bind_clock(self) -> float:
        self._clock = self._deadlines.loop.time
        return self._clock()

    def _wall_offset(self) -> float:
        """Unix time minus event-loop time, to turn `last_seen` into a Unix time.

        Kept until the two clocks drift apart by a millisecond, so that a node's
        reported last heartbeat does not wobble by microseconds from one read to the next.
        """
        offset = wall_time() - self._clock()
        if abs(offset - self._offset) > WALL_OFFSET_TOLERANCE_S:
            self._offset = offset
        return self._offset

    # --- inputs ---------------------------------------------------------------------

    def ingest(self, hb: HostHeartbeat, body: bytes | None = None) -> Changes:
        """Apply one heartbeat. The returned changes must be persisted before the ack.

        Raises HeartbeatError, changing nothing, when `hb` fails `check_heartbeat`; a
        heartbeat that repeats the node's validated picture is not checked again. The
        result may be the shared, empty `UNCHANGED`: read it, never add to it. `body`,
        the JSON `hb` was parsed from, may be kept in place of `hb`'s worker reports
        (see NodeRecord.body); it must not change afterwards.
        """
        node = self._nodes.get(hb.node)
        if (
            node is not None
            and node.alive
            and not node.flapping
            and hb.node not in self.fault_marks.muted
            and hb.state is node.state
            and hb.job == node.job
            and not hb.gpu_reports
        ):
            # The steady state of every node, every period: the same workers in the same
            # states, only steps moving. It is most of the supervisor's CPU at scale, so
            # it is inline and kept to a few C-level passes; anything else takes the
            # general path below.
            workers = hb.workers
            if ",".join(map(_state, workers)) == node.states and (
                tuple(map(_rank, workers)) == node.ranks
            ):
                now = self._clock()
                self.metrics.heartbeats_received += 1
                node.last_seen = now  # moves the loss deadline on (see `_extended`)
                if hb.address != node.address or hb.topology != node.topology:
                    node.address = hb.address
                    node.topology = dict(hb.topology)
                if body is None:
                    node.workers = workers
                else:
                    node.body = body
                    if node.reports:  # stale now: not kept beside the body
                        node.reports = []
                if node.job is None or not workers:
                    return UNCHANGED
                try:
                    step = max(map(_step, workers)) if node.all_running else None
                except TypeError:  # some worker has reported no step yet
                    step = None
                if step is None:
                    learned = self._progress(node, workers, now)
                else:
                    learned = self._observe(self._jobs[node.job], node.name, step, now)
                # What the job learned of its step intervals is kept across restarts:
                # it changes only a few times in a run (a new longest interval).
                return Changes(jobs=[learned]) if learned is not None else UNCHANGED
        check_heartbeat(hb)
        if hb.job is not None and hb.workers:
            self._check_claims(hb)
        now = self._clock()
        self.metrics.heartbeats_received += 1
        changes = Changes()
        if self.fault_marks.is_muted(hb.node):
            return changes  # an injected fault: drop it as a lost packet would be
        if node is None:
            node = self._register(hb, now, changes)
        else:
            self._update(node, hb, now, changes)
        self._deadlines.arm(node.deadline_key, now + self._timeout_s)
        if hb.gpu_reports:
            for report in hb.gpu_reports:
                self._gpu_report(node, report, now, None, changes)
        if node.job is not None and hb.workers:
            learned = self._progress(node, hb.workers, now)
            if learned is not None:
                changes.jobs.append(learned)
        for event in changes.events:
            self.metrics.events.labels(event.type.value).inc()
        return changes

    def inject_gpu_report(self, node_name: str, report: GpuReport, fault_id: int) -> Changes:
        """Act out a GPU error injected as a fault: as if the node had reported it, its
        events carrying the fault's id. KeyError for a node the sensor does not know."""
        node = self._require(node_name)
        changes = Changes()
        self._gpu_report(node, report, self._deadlines.time(), fault_id, changes)
        for event in changes.events:
            self.metrics.events.labels(event.type.value).inc()
        return changes

    def set_cordoned(self, node_name: str, cordoned: bool) -> Changes:
        """The node's record, and `spare_available` when uncordoning makes a spare of it."""
        node = self._nodes.get(node_name)
        if node is None or node.cordoned == cordoned:
            return Changes()
        node.cordoned = cordoned
        changes = Changes(nodes=[node.view(self._wall_offset())])
        if not cordoned and node.alive and node.state is NodeState.SPARE and not node.flapping:
            changes.events.append(self._event(EventType.SPARE_AVAILABLE, node, uncordoned=True))
        return changes

    def job_restarted(self, job_name: str) -> None:
        """The job's workers were restarted (a remediation): until they step again, past
        a warm-up, the job is not watched for hangs (a start-up is no hang)."""
        job = self._jobs.get(job_name)
        if job is None:
            return
        job.progress.restarted()
        job.finishing_since = None
        self._deadlines.disarm((HANG, job_name))
        self._deadlines.disarm((FINISHING, job_name))

    def set_replicas(self, job_name: str, num_dp_replicas: int) -> JobView | None:
        job = self._jobs.get(job_name)
        if job is None:
            return None
        job.num_dp_replicas = num_dp_replicas
        return job.view()

    def restore(self, nodes: Iterable[NodeView], jobs: Iterable[JobView]) -> None:
        """Take back the picture persisted before a restart.

        Nodes that were alive get a fresh grace period of one heartbeat timeout, so a
        restart of the supervisor does not declare the whole cluster lost.
        """
        now = self._deadlines.time()
        for jv in jobs:
            job = self._job(jv.name)
            job.num_dp_replicas = jv.num_dp_replicas
            job.min_num_dp_replicas = jv.min_num_dp_replicas
            job.max_num_dp_replicas = jv.max_num_dp_replicas
            job.num_nodes_per_dp = jv.num_nodes_per_dp
            job.progress.relearn(jv.step_interval_s)
        for nv in nodes:
            seen = nv.last_heartbeat.timestamp() if nv.last_heartbeat else wall_time()
            record = NodeRecord(
                name=nv.name,
                state=nv.state,
                job=nv.job,
                reports=[
                    WorkerReport(
                        rank=w.rank,
                        local_rank=w.local_rank,
                        state=w.state,
                        pid=w.pid,
                        step=w.step,
                        exit_code=w.exit_code,
                    )
                    for w in nv.workers
                ],
                last_seen=now,
                restored_wall=seen,
                alive=nv.alive,
                cordoned=nv.cordoned,
                flapping=nv.flapping,
                up_since=now,
            )
            self._nodes[nv.name] = record
            if nv.job is not None:
                self._job(nv.job).nodes.add(nv.name)
                if nv.alive:  # a node that is not alive holds no rank
                    self._reclaim(nv.name, None, [], nv.job, record.reports)
            if nv.alive:
                self._deadlines.arm((NODE, nv.name), now + self.settings.heartbeat_timeout_s)

    # --- reads ------------------------------------------------------------------------
    # The records are the sensor's own: others read them through these.

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    def has_job(self, name: str) -> bool:
        return name in self._jobs

    def node_names(self) -> list[str]:
        """Every node the sensor knows (alive or not), sorted."""
        return sorted(self._nodes)

    def job_names(self) -> list[str]:
        """Every job the sensor knows, sorted."""
        return sorted(self._jobs)

    def node_address(self, name: str) -> str | None:
        """Where the node's host monitor listens, as its last heartbeat said."""
        node = self._nodes.get(name)
        return node.address if node is not None else None

    def healthy_nodes(self) -> list[tuple[str, NodeState, bool]]:
        """(name, state, cordoned) of each node alive and not flapping: those that may
        serve as spares. Read from the records, without building every node's view."""
        return [
            (node.name, node.state, node.cordoned)
            for node in self._nodes.values()
            if node.alive and not node.flapping
        ]

    def running_jobs(self) -> set[str]:
        """The jobs of which some node reports running."""
        running = NodeState.RUNNING
        nodes = self._nodes
        return {
            name
            for name, job in self._jobs.items()
            if any((node := nodes.get(n)) is not None and node.state is running for n in job.nodes)
        }

    def job_steps(self) -> list[tuple[str, int, float]]:
        """(job, newest step, Unix time the sensor first saw it) for each job with a step."""
        loop_now = self._clock()
        wall_now = wall_time()
        return [
            (name, job.progress.max_step, wall_now - (loop_now - job.progress.last_progress))
            for name, job in self._jobs.items()
            if job.progress.max_step >= 0
        ]

    def node_view(self, name: str) -> NodeView | None:
        node = self._nodes.get(name)
        return node.view(self._wall_offset()) if node else None

    def job_view(self, name: str) -> JobView | None:
        job = self._jobs.get(name)
        return job.view() if job else None

    def snapshot(self) -> tuple[dict[str, NodeView], dict[str, JobView]]:
        offset = self._wall_offset()
        return (
            {name: n.view(offset) for name, n in self._nodes.items()},
            {name: j.view() for name, j in self._jobs.items()},
        )

    def heartbeat_age_s(self, name: str) -> float | None:
        node = self._nodes.get(name)
        if node is None:
            return None
        return max(0.0, wall_time() - node.last_heartbeat(self._wall_offset()))

    def job_phase(self, job_name: str) -> SensedPhase | None:
        """running, finishing or finished (supervisor/sensor/finishing.py); None: unknown."""
        job = self._jobs.get(job_name)
        if job is None:
            return None
        nodes = (self._nodes.get(n) for n in job.nodes)
        workers = [w for n in nodes if n is not None and n.alive for w in n.workers]
        return phase(job.finishing_since, workers)

    def hang_timeout_s(self, job_name: str) -> float | None:
        job = self._jobs.get(job_name)
        return job.progress.timeout_s if job and job.progress.watching else None

    # --- heartbeat handling ---------------------------------------------------------------

    def _register(self, hb: HostHeartbeat, now: float, changes: Changes) -> NodeRecord:
        node = NodeRecord(
            name=hb.node,
            state=hb.state,
            job=hb.job,
            last_seen=now,
            reports=hb.workers,
            ranks=_ranks(hb.workers),
            states=_states(hb.workers),
            all_running=_all_running(hb.workers),
            address=hb.address,
            topology=dict(hb.topology),
            up_since=now,
        )
        self._nodes[hb.node] = node
        if hb.job is not None:
            self._join(node, hb.job, changes)
            self._reclaim(node.name, None, [], hb.job, hb.workers)
        if hb.state is NodeState.SPARE:  # new to this sensor: nothing cordoned it yet
            changes.events.append(self._event(EventType.SPARE_AVAILABLE, node))
        for worker in hb.workers:
            self._worker_changed(node, None, worker, changes)
        changes.nodes.append(node.view(self._wall_offset()))
        return node

    def _update(self, node: NodeRecord, hb: HostHeartbeat, now: float, changes: Changes) -> None:
        node.last_seen = now
        node.restored_wall = None
        changed = False
        if not node.alive:
            node.alive = True
            node.up_since = now
            fault = self.fault_marks.recovered(node.name)
            changed = True
            if node.flapping:
                self.metrics.events_suppressed.labels(EventType.NODE_RECOVERED.value).inc()
            else:
                changes.events.append(
                    self._event(
                        EventType.NODE_RECOVERED, node, fault_id=fault, state=hb.state.value
                    )
                )
            self._rearm_hang(node.job, now)
        elif node.flapping and now - node.up_since >= self.settings.flap_window_s:
            node.flapping = False
            node.losses.clear()
            changed = True
            changes.events.append(
                self._event(EventType.NODE_RECOVERED, node, state=hb.state.value, was_flapping=True)
            )
        if hb.state is not node.state:
            # A node taken out of service (cordoned, or swapped out) idles like a spare
            # but is none: raised when it is uncordoned instead.
            if hb.state is NodeState.SPARE and not node.cordoned:
                changes.events.append(self._event(EventType.SPARE_AVAILABLE, node))
            node.state = hb.state
            changed = True
        old_job = node.job
        if hb.job != node.job:
            if node.job is not None:
                self._leave(node)
            if hb.job is not None:
                self._join(node, hb.job, changes)
            changed = True
        if hb.address != node.address or hb.topology != node.topology:
            node.address = hb.address
            node.topology = dict(hb.topology)
        previous, current = node.workers, hb.workers
        ranks, states = _ranks(current), _states(current)
        if node.ranks is None:  # restored from the database
            node.ranks, node.states = _ranks(previous), _states(previous)
            node.all_running = _all_running(previous)
        # Always (this path is for changes): a node back from the lost, or restored from
        # the database, holds its ranks again.
        self._reclaim(node.name, old_job, previous, hb.job, current)
        if ranks != node.ranks or states != node.states:
            changed = True  # persisted with the node, so a restart knows the states
            by_rank = {w.rank: w for w in previous}
            for worker in current:
                before = by_rank.get(worker.rank)
                if before is None or before.state is not worker.state:
                    self._worker_changed(node, before, worker, changes)
            node.all_running = _all_running(current)
        node.workers = current
        node.ranks, node.states = ranks, states
        if changed:
            changes.nodes.append(node.view(self._wall_offset()))

    def _worker_changed(
        self,
        node: NodeRecord,
        before: WorkerReport | None,
        worker: WorkerReport,
        changes: Changes,
    ) -> None:
        if node.job is not None and ends_the_loop(worker):
            self._finishing(node.job)
        if worker.state is WorkerState.EXITED:
            changes.events.append(
                self._event(
                    EventType.WORKER_EXITED,
                    node,
                    rank=worker.rank,
                    exit_code=worker.exit_code,
                    pid=worker.pid,
                    local_rank=worker.local_rank,
                    step=worker.step,
                )
            )
        elif worker.state is WorkerState.LOST:
            changes.events.append(
                self._event(
                    EventType.WORKER_HEARTBEAT_LOST,
                    node,
                    rank=worker.rank,
                    pid=worker.pid,
                    local_rank=worker.local_rank,
                    step=worker.step,
                )
            )

    def _gpu_report(
        self,
        node: NodeRecord,
        report: GpuReport,
        now: float,
        fault_id: int | None,
        changes: Changes,
    ) -> None:
        observed = (report.time or utcnow()).isoformat()
        if report.kind == "xid":
            if self._repeated(node, ("xid", report.gpu, report.code), now, EventType.GPU_XID):
                return
            xid = classify(report.code, self.settings.xid_responses)
            changes.events.append(
                self._event(
                    EventType.GPU_XID,
                    node,
                    fault_id=fault_id,
                    code=report.code,
                    gpu=report.gpu,
                    message=report.message,
                    observed_at=observed,
                    **xid.details(),
                )
            )
            return
        if report.kind in HEALTH:
            if self._repeated(node, (report.kind, report.gpu, None), now, EventType.GPU_HEALTH):
                return
            changes.events.append(
                self._event(
                    EventType.GPU_HEALTH,
                    node,
                    fault_id=fault_id,
                    kind=report.kind,
                    gpu=report.gpu,
                    count=report.count,
                    message=report.message,
                    observed_at=observed,
                    **HEALTH[report.kind].details(),
                )
            )
            return
        assert report.count is not None  # guaranteed by GpuReport's validator
        if node.ecc_counts is None:
            node.ecc_counts = {}
        before = node.ecc_counts.get(report.gpu, 0)
        node.ecc_counts[report.gpu] = report.count
        if report.count > before:
            changes.events.append(
                self._event(
                    EventType.GPU_ECC,
                    node,
                    fault_id=fault_id,
                    gpu=report.gpu,
                    count=report.count,
                    new_errors=report.count - before,
                    message=report.message,
                    observed_at=observed,
                )
            )

    def _repeated(
        self,
        node: NodeRecord,
        key: tuple[str, int | None, int | None],
        now: float,
        type_: EventType,
    ) -> bool:
        """Whether this GPU report repeats one of the node's within the cooldown (then it
        is counted as suppressed); else it is noted as the newest of its key."""
        if node.gpu_seen is None:
            node.gpu_seen = {}
        last = node.gpu_seen.get(key)
        if last is not None and now - last < self.settings.gpu_report_cooldown_s:
            self.metrics.events_suppressed.labels(type_.value).inc()
            return True
        node.gpu_seen[key] = now
        return False

    def _progress(
        self, node: NodeRecord, workers: list[WorkerReport], now: float
    ) -> JobView | None:
        """Take the node's newest step: the highest of its running workers' steps. The
        job's view when what it learned of its step intervals changed (to persist)."""
        assert node.job is not None
        job = self._jobs[node.job]
        running = WorkerState.RUNNING
        step = max(
            [w.step for w in workers if w.state is running and w.step is not None], default=-1
        )
        if step < 0:
            # A worker that finished reports its last steps after the loop ended: they
            # count, but only forward (an old attempt's stopped worker is no rollback).
            step = max([w.step for w in workers if _finished(w) and w.step is not None], default=-1)
            if step <= job.progress.max_step:
                return None
        if step >= 0:
            return self._observe(job, node.name, step, now)
        return None

    def _observe(self, job: JobRecord, node_name: str, step: int, now: float) -> JobView | None:
        progress = job.progress
        learned = progress.learned_interval_s
        if not progress.observe(node_name, step, now):
            return None
        self._advanced(job, now)
        return job.view() if progress.learned_interval_s != learned else None

    def _advanced(self, job: JobRecord, now: float) -> None:
        """The job made progress: watch it for a hang again from now."""
        job.hang_reported = False
        if job.progress.watching and job.finishing_since is None:
            self._deadlines.arm((HANG, job.name), now + job.progress.timeout_s)

    def _rearm_hang(self, job_name: str | None, now: float) -> None:
        """Watch the job for hangs again (after a lost node of it came back)."""
        job = self._jobs.get(job_name) if job_name else None
        if (
            job is not None
            and job.progress.watching
            and not job.hang_reported
            and job.finishing_since is None
        ):
            self._deadlines.arm((HANG, job.name), now + job.progress.timeout_s)

    def _finishing(self, job_name: str) -> None:
        """A worker of the job left its loop: no hang watch from now, but the end's bound."""
        job = self._jobs.get(job_name)
        if job is None or job.finishing_since is not None:
            return
        now = self._deadlines.time()
        job.finishing_since = now
        self._deadlines.disarm((HANG, job_name))
        self._deadlines.arm((FINISHING, job_name), now + self.settings.finishing_timeout_s)

    # --- membership ---------------------------------------------------------------------

    def _job(self, name: str) -> JobRecord:
        job = self._jobs.get(name)
        if job is None:
            s = self.workload
            job = JobRecord(
                name=name,
                num_dp_replicas=s.num_dp_replicas,
                min_num_dp_replicas=s.min_num_dp_replicas,
                max_num_dp_replicas=s.max_num_dp_replicas,
                num_nodes_per_dp=s.num_nodes_per_dp,
                progress=JobProgress(self._hang),
            )
            self._jobs[name] = job
        return job

    def _join(self, node: NodeRecord, job_name: str, changes: Changes) -> None:
        new = job_name not in self._jobs
        job = self._job(job_name)
        job.nodes.add(node.name)
        node.job = job_name
        if new:
            changes.jobs.append(job.view())
        if (STRAGGLERS, "") not in self._deadlines:
            period = self.settings.heartbeat_polling_period_s
            self._deadlines.arm((STRAGGLERS, ""), self._deadlines.time() + period)

    def _leave(self, node: NodeRecord) -> None:
        if node.job is None:
            return
        job = self._jobs.get(node.job)
        if job is not None:
            job.nodes.discard(node.name)
            job.progress.forget(node.name)
        node.job = None

    def _check_claims(self, hb: HostHeartbeat) -> None:
        """Raise RankClaimed when a running or starting worker of `hb` has a rank that
        another node of the job, alive, reports running or starting. A node that is not
        alive holds nothing: a spare swapped in for it takes its ranks."""
        assert hb.job is not None
        job = self._jobs.get(hb.job)
        if job is None or not job.claims:
            return
        claims = job.claims
        for index, worker in enumerate(hb.workers):
            if worker.state not in _CLAIMING:
                continue
            holder = claims.get(worker.rank)
            if holder is None or holder == hb.node:
                continue
            other = self._nodes.get(holder)
            if other is not None and other.alive and other.job == hb.job:
                raise RankClaimed(hb.job, worker.rank, holder, index)

    def _reclaim(
        self,
        node_name: str,
        old_job: str | None,
        before: list[WorkerReport],
        new_job: str | None,
        after: list[WorkerReport],
    ) -> None:
        """Move the node's rank claims from its previous workers to its current ones
        (`_check_claims` allowed them)."""
        if old_job is not None and (job := self._jobs.get(old_job)) is not None:
            for worker in before:
                if job.claims.get(worker.rank) == node_name:
                    del job.claims[worker.rank]
        if new_job is not None:
            claims = self._job(new_job).claims
            for worker in after:
                if worker.state in _CLAIMING:
                    claims[worker.rank] = node_name

    def _require(self, name: str) -> NodeRecord:
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(name)
        return node

    # --- deadlines --------------------------------------------------------------------

    def _extended(self, key: DeadlineKey, deadline: float) -> float:
        """The key's latest deadline: steady heartbeats move a node's on without arming."""
        kind, name = key
        if kind == NODE:
            node = self._nodes.get(name)
            if node is not None and node.alive:
                return node.last_seen + self._timeout_s
        return deadline

    def _expired(self, key: DeadlineKey, deadline: float) -> None:
        kind, name = key
        changes = Changes()
        if kind == NODE:
            self._node_lost(name, deadline, changes)
        elif kind == STRAGGLERS:
            self._check_stragglers(changes)
        elif kind == FINISHING:
            self._finishing_overdue(name, changes)
        else:
            self._job_hung(name, changes)
        if changes:
            for event in changes.events:
                self.metrics.events.labels(event.type.value).inc()
            self._emit(changes)

    def _node_lost(self, name: str, deadline: float, changes: Changes) -> None:
        node = self._nodes.get(name)
        if node is None or not node.alive:
            return
        now = self._deadlines.time()
        lateness = now - deadline
        self.metrics.detection_lateness.observe(lateness)
        node.alive = False
        if node.job is not None:
            # The job stalls while the node is gone; that is not a separate hang.
            self._deadlines.disarm((HANG, node.job))
        window = self.settings.flap_window_s
        node.losses = [t for t in node.losses if now - t <= window]
        node.losses.append(now)
        cause = self.fault_marks.loss_cause(node.name)
        details: dict[str, Any] = {
            "last_heartbeat": datetime.fromtimestamp(
                node.last_heartbeat(self._wall_offset()), UTC
            ).isoformat(),
            "heartbeat_timeout_s": self.settings.heartbeat_timeout_s,
            "lateness_ms": round(lateness * 1000, 3),
        }
        if node.flapping:
            self.metrics.events_suppressed.labels(EventType.HOST_HEARTBEAT_LOST.value).inc()
        elif len(node.losses) >= self.settings.flap_max_losses:
            node.flapping = True
            changes.events.append(
                self._event(
                    EventType.NODE_FLAPPING,
                    node,
                    fault_id=cause,
                    losses=len(node.losses),
                    window_s=window,
                    **details,
                )
            )
        else:
            changes.events.append(
                self._event(EventType.HOST_HEARTBEAT_LOST, node, fault_id=cause, **details)
            )
        changes.nodes.append(node.view(self._wall_offset()))

    def _check_stragglers(self, changes: Changes) -> None:
        """Every heartbeat period: one sample per running rank that reports its compute
        time, then the stragglers and recoveries that became due (see stragglers.py)."""
        now = self._deadlines.time()
        self._deadlines.arm((STRAGGLERS, ""), now + self.settings.heartbeat_polling_period_s)
        for node in self._nodes.values():
            if not node.alive or node.job is None:
                continue
            # Most nodes' newest heartbeat is kept as its bytes: decoded only if it has
            # compute times at all.
            if node.body is not None and b'"compute_s"' not in node.body:
                continue
            for worker in node.workers:
                if worker.state is WorkerState.RUNNING and worker.compute_s is not None:
                    self.stragglers.observe(node.job, worker.rank, node.name, worker.compute_s, now)
        params = self.stragglers.params
        for verdict in self.stragglers.evaluate(now):
            record = self._nodes.get(verdict.node)
            if record is None or record.job != verdict.job:
                continue
            changes.events.append(
                self._event(
                    EventType.STRAGGLER if verdict.slow else EventType.STRAGGLER_RECOVERED,
                    record,
                    rank=verdict.rank,
                    score=round(verdict.score, 3),
                    slowdown_pct=round((verdict.score - 1) * 100, 1),
                    compute_s=round(verdict.compute_s, 6),
                    typical_s=round(verdict.typical_s, 6),
                    for_s=round(now - verdict.since, 3),
                    threshold=params.threshold,
                    window_s=params.window_s,
                )
            )

    def _finishing_overdue(self, name: str, changes: Changes) -> None:
        """`finishing_timeout_s` after the job began to end: a worker still finishing is
        stuck, a hang of its own kind."""
        job = self._jobs.get(name)
        if job is None or job.finishing_since is None:
            return
        nodes = [(n, self._nodes[n]) for n in job.nodes if n in self._nodes]
        found = stuck((n, node.workers) for n, node in nodes if node.alive)
        if found is None:
            return
        node = self._nodes[found[0]]
        now = self._deadlines.time()
        changes.events.append(
            self._event(
                EventType.HANG,
                node,
                rank=found[1],
                kind="finishing",
                last_step=job.progress.max_step if job.progress.max_step >= 0 else None,
                stalled_for_s=round(now - job.finishing_since, 3),
                hang_timeout_s=self.settings.finishing_timeout_s,
            )
        )

    def _job_hung(self, name: str, changes: Changes) -> None:
        job = self._jobs.get(name)
        if job is None or job.hang_reported or job.finishing_since is not None:
            return
        alive = [self._nodes[n] for n in job.nodes if n in self._nodes and self._nodes[n].alive]
        if not alive:
            return  # every node is gone: the heartbeat-lost events already tell
        if not any(w.state in _MAY_HANG for node in alive for w in node.workers):
            # Finished, stopped on purpose, or exited (an exit is an event of its own):
            # nothing is left to hang. Progress arms the check again.
            return
        now = self._deadlines.time()
        silent = [
            node.last_seen + self._timeout_s
            for node in alive
            if now - node.last_seen > _SILENT_PERIODS * self.settings.heartbeat_polling_period_s
        ]
        if silent:
            # A node of the job has missed its heartbeats: the job stalls because of it,
            # most likely. Its heartbeat deadline decides first (a lost node disarms this
            # check and is remediated once, as a node loss); then look again.
            self._deadlines.arm((HANG, name), max(silent) + _AFTER_NODE_DEADLINE_S)
            return
        job.hang_reported = True
        suspect = job.progress.laggard()
        node = self._nodes.get(suspect[0]) if suspect else None
        rank = None
        if node is not None:
            ranks = [w.rank for w in node.workers if w.state is WorkerState.RUNNING]
            rank = min(ranks) if ranks else None
        changes.events.append(
            Event(
                type=EventType.HANG,
                time=utcnow(),
                node=node.name if node else None,
                job=name,
                rank=rank,
                details=HangDetails(
                    last_step=job.progress.max_step,
                    stalled_for_s=round(now - job.progress.last_progress, 3),
                    hang_timeout_s=round(job.progress.timeout_s, 3),
                    timeout_learned=job.progress.learned,
                    suspect_step=suspect[1] if suspect else None,
                ).mapping(),
            )
        )

    # --- helpers ----------------------------------------------------------------------

    def _event(
        self,
        type_: EventType,
        node: NodeRecord,
        *,
        rank: int | None = None,
        fault_id: int | None = None,
        **details: Any,
    ) -> Event:
        if fault_id is None:
            fault_id = self.fault_marks.attributed(node.name)
        return Event(
            type=type_,
            time=utcnow(),
            node=node.name,
            job=node.job,
            rank=rank,
            # Through the type's model: a field it does not declare cannot be emitted.
            details=EVENT_DETAILS[type_](**details).mapping(),
            fault_id=fault_id,
        )


# Worker fields read with map() in C on every heartbeat. WorkerState is a StrEnum, so the
# states join into one plain str.
_rank = operator.attrgetter("rank")
_state = operator.attrgetter("state")
_step = operator.attrgetter("step")


#: Worker states in which a job can hang: with none of them left, a stall is the end.
_MAY_HANG = frozenset({WorkerState.RUNNING, WorkerState.STARTING})
#: Worker states that hold their rank: no other node may run it meanwhile.
_CLAIMING = frozenset({WorkerState.RUNNING, WorkerState.STARTING, WorkerState.FINISHING})
#: A node this many polling periods past its last heartbeat counts as silent.
_SILENT_PERIODS = 1.5
#: A deferred hang check runs this long after the silent node's heartbeat deadline.
_AFTER_NODE_DEADLINE_S = 0.01


def _finished(worker: WorkerReport) -> bool:
    """Stopped on purpose, or exited with success."""
    return worker.state is WorkerState.STOPPED or (
        worker.state is WorkerState.EXITED and worker.exit_code == 0
    )


def _ranks(workers: list[WorkerReport]) -> tuple[int, ...]:
    return tuple(map(_rank, workers))


def _states(workers: list[WorkerReport]) -> str:
    """The workers' states joined into one str (`ingest`'s fast path builds it inline)."""
    return ",".join(map(_state, workers))


def _all_running(workers: list[WorkerReport]) -> bool:
    return all(w.state is WorkerState.RUNNING for w in workers)
