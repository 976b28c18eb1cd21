"""The sensor: keeps the live picture of every node in memory and turns changes into events.

A heartbeat only updates memory and moves a deadline. Events come from state changes
(a worker exits, a GPU error is reported, a node comes back) and from deadlines passing
(a node goes silent, a job stops making progress). The caller persists what
`ingest` returns before acknowledging; timer-driven changes go to the `emit` callback.

What the sensor does with a heartbeat is in this module; the parts it uses are beside it
in the package (see the package's docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport, check_heartbeat
from supervisor.config_parts import SensingSettings, WorkloadSettings
from supervisor.domain import EventType, JobView, NodeState, NodeView, WorkerState
from supervisor.metrics import Metrics
from supervisor.sensor.changes import UNCHANGED, Changes
from supervisor.sensor.claims import RankClaimed, check_claims, claim, release
from supervisor.sensor.events import NodeEvents
from supervisor.sensor.expiries import FINISHING, HANG, STRAGGLERS, DeadlineHandlers
from supervisor.sensor.fault_marks import FaultMarks
from supervisor.sensor.finishing import ends_the_loop, finished, out_of_the_loop
from supervisor.sensor.gpu_reports import GpuReports
from supervisor.sensor.jobs import JobRecord
from supervisor.sensor.nodes import NODE, DeadlineKey, NodeRecord, rank_of, state_of, step_of
from supervisor.sensor.peer_cuts import PeerCuts, peer_cut_confirm_s
from supervisor.sensor.progress import HangParams, JobProgress
from supervisor.sensor.reads import SensorReads
from supervisor.sensor.stragglers import StragglerParams, StragglerScorer
from supervisor.sensor.views import NodeViews

# Imported from here by other packages (the API, the simulation).
__all__ = [
    "FINISHING",
    "HANG",
    "NODE",
    "STRAGGLERS",
    "UNCHANGED",
    "Changes",
    "DeadlineKey",
    "RankClaimed",
    "Sensor",
]


class Sensor(SensorReads, DeadlineHandlers):
    """Heartbeats, silence and timers in; events, and node and job records to persist, out.

    Inputs: `ingest` (a heartbeat), `restore` (the persisted picture, at start-up), and
    what the supervisor tells of its own actions (`set_cordoned`, `job_restarted`,
    `set_replicas`). Faults injected in the sensor: a GPU error (`inject_gpu_report`), and
    `fault_marks` (muted heartbeats, expected failures), which fault injection writes.
    Reads: `SensorReads` (reads.py).
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
        self._node_views = NodeViews()
        self._changed = self._node_views.changed  # see views.py: marked on every change
        super().__init__(self._expired, self._extended, settings.heartbeat_timeout_s)
        #: Injected faults' marks: muted nodes, and the faults failures are attributed to
        #: (fault injection writes them, see `supervisor.fault_injection`; the sensor reads them).
        self.fault_marks = FaultMarks(self._deadlines.time)
        events = NodeEvents(self.fault_marks)
        self._event = events.event
        self._gpu = GpuReports(settings, self.metrics, events)
        self._cuts = PeerCuts(self._nodes, self._event, peer_cut_confirm_s(settings))
        self._timeout_s = settings.heartbeat_timeout_s
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
            and not (hb.unreachable_peers or node.unreachable)
        ):
            # The steady state of every node, every period: the same workers in the same
            # states, only steps moving. It is most of the supervisor's CPU at scale, so
            # it is inline and kept to a few C-level passes; anything else takes the
            # general path below.
            workers = hb.workers
            if ",".join(map(state_of, workers)) == node.states and (
                tuple(map(rank_of, workers)) == node.ranks
            ):
                now = self._clock()
                self.metrics.heartbeats_received += 1
                node.last_seen = now  # moves the loss deadline on (see `_extended`)
                if hb.address != node.address or hb.topology != node.topology:
                    node.address = hb.address
                    node.topology = dict(hb.topology)
                node.heard_again(workers, body)
                self._changed.add(node.name)
                if node.job is None or not workers:
                    return UNCHANGED
                try:
                    step = max(map(step_of, workers)) if node.all_running else None
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
        if hb.job is not None and hb.workers and (job := self._jobs.get(hb.job)) is not None:
            check_claims(hb, job, self._nodes)
        now = self._clock()
        self.metrics.heartbeats_received += 1
        changes = Changes()
        if self.fault_marks.is_muted(hb.node):
            return changes  # an injected fault: drop it as a lost packet would be
        if node is None:
            node = self._register(hb, now, changes)
        else:
            self._update(node, hb, now, changes)
        self._changed.add(node.name)
        self._deadlines.arm(node.deadline_key, now + self._timeout_s)
        if hb.unreachable_peers or node.unreachable:
            changes.events += self._cuts.heard(node, hb.unreachable_peers, now)
        if hb.gpu_reports:
            for report in hb.gpu_reports:
                if (event := self._gpu.event(node, report, now, None)) is not None:
                    changes.events.append(event)
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
        event = self._gpu.event(node, report, self._deadlines.time(), fault_id)
        if event is None:
            return Changes()
        self.metrics.events.labels(event.type.value).inc()
        return Changes(events=[event])

    def set_cordoned(self, node_name: str, cordoned: bool) -> Changes:
        """The node's record, and `spare_available` when uncordoning makes a spare of it."""
        node = self._nodes.get(node_name)
        if node is None or node.cordoned == cordoned:
            return Changes()
        node.cordoned = cordoned
        self._changed.add(node_name)
        changes = Changes(nodes=[node.view(self._wall_offset())])
        if not cordoned and node.alive and node.state is NodeState.SPARE and not node.flapping:
            changes.events.append(self._event(EventType.SPARE_AVAILABLE, node, uncordoned=True))
        return changes

    def swapped_out(self, node_name: str) -> Changes:
        """A hot-swap or a scale-down took the node out of its job: cordoned, and out of
        the job's nodes (a heartbeat of it that still runs the job brings it back)."""
        changes = self.set_cordoned(node_name, True)
        node = self._nodes.get(node_name)
        if node is None or node.job is None:
            return changes
        self._leave(node)
        return Changes.merged([changes, Changes(nodes=[node.view(self._wall_offset())])])

    def job_restarted(self, job_name: str) -> None:
        """The job's workers were restarted (a remediation): until they step again, past
        a warm-up, the job is not watched for hangs (a start-up is no hang)."""
        job = self._jobs.get(job_name)
        if job is None:
            return
        job.progress.restarted()
        job.finishing_since = None
        job.hang_deferred_at = None
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
            record = NodeRecord.restored(nv, now)
            self._nodes[nv.name] = record
            self._changed.add(nv.name)
            if nv.job is not None:
                self._job(nv.job).nodes.add(nv.name)
                if nv.alive:  # a node that is not alive holds no rank
                    claim(self._job(nv.job), nv.name, record.workers)
            if nv.alive:
                self._deadlines.arm((NODE, nv.name), now + self.settings.heartbeat_timeout_s)

    # --- heartbeat handling ---------------------------------------------------------------

    def _register(self, hb: HostHeartbeat, now: float, changes: Changes) -> NodeRecord:
        node = NodeRecord(
            hb.node,
            hb.state,
            hb.job,
            now,
            hb.workers,
            address=hb.address,
            topology=dict(hb.topology),
            up_since=now,
        )
        self._nodes[hb.node] = node
        if hb.job is not None:
            self._join(node, hb.job, changes)
            claim(self._job(hb.job), node.name, hb.workers)
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
        # Always (this path is for changes): a node back from the lost, or restored from
        # the database, holds its ranks again.
        if old_job is not None and (job := self._jobs.get(old_job)) is not None:
            release(job, node.name, previous)
        if hb.job is not None:
            claim(self._job(hb.job), node.name, current)
        if node.heard(current):
            changed = True  # persisted with the node, so a restart knows the states
            by_rank = {w.rank: w for w in previous}
            for worker in current:
                before = by_rank.get(worker.rank)
                if before is None or before.state is not worker.state:
                    self._worker_changed(node, before, worker, changes)
        if changed:
            changes.nodes.append(node.view(self._wall_offset()))

    def _worker_changed(
        self,
        node: NodeRecord,
        before: WorkerReport | None,
        worker: WorkerReport,
        changes: Changes,
    ) -> None:
        if node.job is not None and out_of_the_loop(worker):
            self._jobs[node.job].progress.ended()  # what follows is no step interval
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
            step = max([w.step for w in workers if finished(w) and w.step is not None], default=-1)
            if step <= job.progress.max_step:
                return None
        if step >= 0:
            return self._observe(job, node.name, step, now)
        return None

    def _observe(self, job: JobRecord, node_name: str, step: int, now: float) -> JobView | None:
        progress = job.progress
        learned = progress.learned_interval_s
        if not progress.observe(node_name, step, now, ending=job.finishing_since is not None):
            return None
        self._advanced(job, now)
        return job.view() if progress.learned_interval_s != learned else None

    def _advanced(self, job: JobRecord, now: float) -> None:
        """The job made progress: watch it for a hang again from now."""
        job.hang_reported = False
        job.hang_deferred_at = None
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
        self._changed.add(node.name)

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
