"""The node as this agent keeps it: its state and job, its workers, and what may change them.

The HTTP routes (server.py) call these methods; nothing here knows about HTTP. Starting
and stopping workers are serialized: one such change at a time, however many requests
the actuator sends.

How a node gets and leaves its job:
- local backend: the actuator starts workers for a job (`start_workers`) and releases the
  node (`stop_workers` with `release`);
- Kubernetes: the host monitor (a DaemonSet pod) starts as a spare; the first worker pod
  that registers names its job (`WorkerRegistration.job`) and the node runs that job.
  When every worker has gone (pods deleted: `stopped`; crashed: `exited`) for
  `idle_release_s`, and a heartbeat carried their last states, the node is a spare again
  (`release_if_idle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from host_monitor.answered_requests import AnsweredRequests
from host_monitor.assigned_worlds import AssignedWorlds
from host_monitor.config import HostMonitorSettings
from host_monitor.emergency import EmergencyRounds
from host_monitor.heartbeat import NodeSnapshot, world_of
from host_monitor.request_checks import InvalidRequest, check_env, check_start
from host_monitor.standby import Standbys
from host_monitor.wire import WorkerReport
from host_monitor.worker_env import ENV_JOB, ENV_REQUEST_FILE, WorkerEnvironment
from host_monitor.workers import Worker, WorkerConflict, WorkerRegistry
from resiliency_protocol import worker_env
from resiliency_protocol.checkpoint_reports import CheckpointReport
from resiliency_protocol.clock import utcnow
from resiliency_protocol.node_commands import (
    AssignWorldRequest,
    AssignWorldResult,
    CheckpointPeer,
    NodeStatus,
    RejoinRequest,
    RejoinResult,
    StandbyRequest,
    StandbyResult,
    StartWorkersRequest,
    StopWorkersRequest,
    StopWorkersResult,
    WorkerStatus,
)
from resiliency_protocol.states import NodeState
from resiliency_protocol.worker_wire import (
    ProgressReply,
    WorkerFinishing,
    WorkerProgress,
    WorkerRegistration,
    WorkerStopping,
    WorldAssignment,
)
from resiliency_protocol.worlds import parse_world

log = logging.getLogger(__name__)

STANDBY_DELAY_S = 5.0  # after a start, before its standby is started
KEEP_CHECKPOINTS = 100


def _rank(worker: Worker) -> int:
    return worker.rank


#: Report keys remembered, to keep a report sent again once (a worker sends again within
#: seconds: this is hours of reports on a node).
KEEP_REPORT_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    rank: int
    report: CheckpointReport
    time: str  # ISO, UTC
    key: str | None = None  # the worker's name for it (`REPORT_KEY_HEADER`)


class Node:
    def __init__(self, settings: HostMonitorSettings, worker_token: str, base_url: str) -> None:
        self.name = settings.node
        self.state = NodeState(settings.initial_state)
        self.job = settings.job
        self.idle_release_s = settings.idle_release_s
        self.run_dir = settings.run_dir
        self.base_url = base_url
        self.worker_env = WorkerEnvironment(settings, worker_token, base_url)
        self.registry = WorkerRegistry(
            settings.worker_heartbeat_timeout_s, on_change=self._worker_changed
        )
        self.rounds = EmergencyRounds(self.registry)
        self.standbys = Standbys(self.run_dir, self.name)
        self.checkpoints: deque[CheckpointRecord] = deque(maxlen=KEEP_CHECKPOINTS)
        self._report_keys: OrderedDict[str, None] = OrderedDict()
        # Set by the agent to its heartbeat sender's trigger: a change goes out at once.
        self.on_change: Callable[[], None] = lambda: None
        # Set by the agent to its checkpoint forwarder: called, and it must have kept the
        # report durably, before the worker's report is acknowledged.
        self.on_checkpoint: Callable[[CheckpointRecord, str | None], None] | None = None
        # Set by the agent to its heartbeat sender's: seconds since the supervisor last
        # answered (None: never, or no supervisor), told to workers for their lease.
        self.supervisor_heard: Callable[[], float | None] = lambda: None
        # Set by the agent when it heartbeats: a node releases itself only once the
        # supervisor has seen its workers' exits (`delivered`).
        self.wait_for_delivery = False
        self._version = 0  # bumped on every change of state, job or worker state
        self._delivered_version = 0
        self._idle_since: float | None = None  # monotonic: when its last worker went
        self._starts = AnsweredRequests[StartWorkersRequest, bool]("start")
        self._rejoins = AnsweredRequests[RejoinRequest, RejoinResult]("rejoin")
        self._worlds = AssignedWorlds()
        self._assigned = AnsweredRequests[AssignWorldRequest, AssignWorldResult]("world")
        self._lock = asyncio.Lock()
        # The partner of the peer checkpoint tier (peer/tier.py): from the start request,
        # or PUT /v1/checkpoint-peer. A relation of the job: a released node has none.
        self.checkpoint_peer: CheckpointPeer | None = None
        # The world (WORKLOAD_ATTEMPT) of the last start: its workers' until they report one.
        self.start_world: int | None = None

    # --- reads ----------------------------------------------------------------------------

    def status(self) -> NodeStatus:
        return NodeStatus(
            node=self.name, state=self.state, job=self.job, workers=self.registry.statuses()
        )

    def snapshot(self) -> NodeSnapshot:
        return NodeSnapshot(
            state=self.state,
            job=self.job,
            workers=[
                WorkerReport(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    state=w.state,
                    step=w.step,
                    exit_code=w.exit_code,
                    compute_s=w.compute_s,
                    world=self.world_of(w),
                )
                for _, w in sorted(self.registry.workers.items())
            ],
            version=self._version,
        )

    def world_of(self, worker: Worker) -> int | None:
        """The world `worker` belongs to (None: not known)."""
        joining = worker.world[0] if worker.world is not None else None
        return world_of(worker.attempt, joining, self.start_world)

    def delivered(self, snapshot: NodeSnapshot) -> None:
        """The supervisor accepted a heartbeat made of `snapshot`."""
        self._delivered_version = max(self._delivered_version, snapshot.version)

    # --- actuator -------------------------------------------------------------------------

    async def start_workers(self, req: StartWorkersRequest) -> NodeStatus:
        async with self._lock:
            if self._starts.answered(req.request_id, req):
                log.info("start %s asked again: already done", req.request_id)
                return self.status()
            check_start(req, self.job, self.registry.live())
            self.registry.forget()  # the finished workers of a previous start
            launched: list[Worker] = []
            try:
                for spec in sorted(req.workers, key=lambda s: s.rank):
                    request_file = self.worker_env.request_file(req, spec.rank)
                    env = self.worker_env.of_rank(req, spec.rank, spec.local_rank)
                    env[ENV_REQUEST_FILE] = str(request_file)
                    log_path = self.worker_env.log_path(req, spec.rank)
                    standby = (
                        # In a thread: the standby's answer (a fork) keeps the loop waiting.
                        await asyncio.to_thread(
                            self.standbys.take, req.job, req.command, env, log_path
                        )
                        if req.standby_preload
                        else None
                    )
                    launched.append(
                        self.registry.launch(
                            spec.rank,
                            spec.local_rank,
                            req.command,
                            env,
                            log_path,
                            request_file,
                            standby=standby,
                        )
                    )
            except (OSError, ValueError) as exc:  # ValueError: a NUL byte in an argument
                # All ranks run one command: if one cannot start, none should run.
                await self.registry.stop(0, only=launched)
                self.registry.forget(w.rank for w in launched)
                raise InvalidRequest("command", f"cannot run {req.command[0]!r}: {exc}") from None
            self.state = NodeState.RUNNING
            self.job = req.job
            self.checkpoint_peer = req.checkpoint_peer
            self.start_world = parse_world(req.env.get(worker_env.WORKLOAD_ATTEMPT))
            if req.standby_preload:  # the next start of this job here takes it
                # Later, not now: importing torch would take CPU from the ranks starting.
                asyncio.get_running_loop().call_later(
                    STANDBY_DELAY_S,
                    self.standbys.prepare,
                    req.job,
                    req.command,
                    self.worker_env.of_standby(req),
                    req.standby_preload,
                )
            self._starts.remember(req.request_id, req, True)
            log.info(
                "start %s: job %s, ranks %s",
                req.request_id,
                req.job,
                [w.rank for w in launched],
            )
            self._changed()
            return self.status()

    async def stop_workers(self, req: StopWorkersRequest) -> StopWorkersResult:
        async with self._lock:
            codes = await self.registry.stop(req.grace_s)
            if req.release:
                survivors = self.registry.live()
                if survivors:
                    log.error(
                        "releasing the node although ranks %s did not die",
                        [w.rank for w in survivors],
                    )
                self.registry.forget()
                self.state = NodeState.SPARE
                self.job = None
                self.checkpoint_peer = None
                log.info("released: node is a spare")
            self._changed()
            return StopWorkersResult(exit_codes=codes)

    def prepare_standby(self, req: StandbyRequest) -> StandbyResult:
        """A warm standby of the job's command, for when this node takes one of its ranks."""
        check_env(req.env)
        env = self.worker_env.of_job(req.job, req.env)
        ready = self.standbys.prepare(req.job, req.command, env, req.preload)
        return StandbyResult(ready=ready, warm=ready and self.standbys.warm)

    async def shutdown(self, grace_s: float) -> None:
        """The agent is stopping: stop the workers we launched (not the adopted ones)."""
        self.standbys.drop()
        async with self._lock:
            if any(w.launched for w in self.registry.live()):
                log.info("stopping launched workers (grace %.1fs)", grace_s)
            await self.registry.stop(grace_s, launched_only=True)
        await self.rounds.close()

    # --- workers --------------------------------------------------------------------------

    def register(self, reg: WorkerRegistration) -> WorkerStatus:
        """Adopt (or recognise) a worker. A registration naming a job moves a spare node,
        or one whose workers are all gone, to that job. Raises WorkerConflict, changing
        nothing, when the job or the process does not fit."""
        joining = self._job_joined_by(reg)
        # A new pod of the node's job once every earlier worker is gone (a restart that
        # put other ranks here): the earlier ones would stay in our heartbeats as exited
        # or stopped for as long as the node serves the job. They are dropped, as on a
        # release, once the supervisor has accepted a heartbeat with their final states.
        earlier = list(self.registry.workers.values())
        replaced = (
            joining is None
            and bool(earlier)
            and not any(w.alive or w.launched for w in earlier)
            and (not self.wait_for_delivery or self._delivered_version >= self._version)
        )
        worker = self.registry.register(reg)  # may refuse: then nothing has changed
        if replaced:
            self.registry.forget(w.rank for w in earlier if w.rank != reg.rank)
        self._idle_since = None
        if joining is not None:
            previous = self.job if self.state is NodeState.RUNNING else None
            self.registry.forget()  # finished workers of a previous job (not this one)
            self.state = NodeState.RUNNING
            self.job = joining
            if previous is None:
                log.info("rank %d registered for job %s: the node runs it", reg.rank, joining)
            else:
                log.info(
                    "rank %d registered for job %s: the node leaves job %s for it",
                    reg.rank,
                    joining,
                    previous,
                )
        self._deliver_world(worker)
        self._changed()
        return worker.status()

    def stopping(self, rank: int, report: WorkerStopping) -> WorkerStatus:
        return self.registry.stopping(rank, report).status()

    def finishing(self, rank: int, report: WorkerFinishing) -> WorkerStatus:
        return self.registry.finishing(rank, report).status()

    def progress(self, rank: int, report: WorkerProgress) -> ProgressReply:
        self.registry.progress(rank, report.step, report.attempt, report.compute_s)
        heard = self.supervisor_heard()
        return ProgressReply(supervisor_heard_s=None if heard is None else max(0.0, heard))

    def world(self, rank: int) -> WorldAssignment:
        worker = self.registry.get(rank)
        if worker.world is None:
            return WorldAssignment(attempt=None)
        attempt, env = worker.world
        return WorldAssignment(attempt=attempt, env=env)

    async def rejoin(self, req: RejoinRequest) -> RejoinResult:
        """Give the job's live, registered workers a new world (in-process restart)."""
        async with self._lock:
            if (done := self._rejoins.answered(req.request_id, req)) is not None:
                return done
            if req.job != self.job:
                raise WorkerConflict(f"job: this node runs job {self.job!r}, not {req.job!r}")
            check_env(req.env)
            live = [w for w in self.registry.live() if w.registered]
            if not live:
                raise WorkerConflict(
                    f"no live worker of job {req.job!r} on this node to rejoin: start them"
                )
            for worker in live:
                worker.world = (req.attempt, dict(req.env))
            if "checkpoint_peer" in req.model_fields_set:  # the new world's partner
                self.checkpoint_peer = req.checkpoint_peer
            result = RejoinResult(
                request_id=req.request_id,
                attempt=req.attempt,
                ranks=sorted(w.rank for w in live),
            )
            self._rejoins.remember(req.request_id, req, result)
            log.info("rejoin %s: ranks %s to attempt %s", req.request_id, result.ranks, req.attempt)
            self._changed()
            return result

    def assign_world(self, req: AssignWorldRequest) -> AssignWorldResult:
        """Keep the world of `req.rank` for its instance; hand it to that worker now if it
        is registered here, else when it registers."""
        if (done := self._assigned.answered(req.request_id, req)) is not None:
            return done
        check_env(req.env)
        self._worlds.keep(req)
        worker = self.registry.workers.get(req.rank)
        delivered = worker is not None and self._deliver_world(worker)
        result = AssignWorldResult(
            request_id=req.request_id, rank=req.rank, attempt=req.attempt, delivered=delivered
        )
        self._assigned.remember(req.request_id, req, result)
        log.info(
            "world %s of job %s for rank %d (instance %s)%s",
            req.attempt,
            req.job,
            req.rank,
            req.instance,
            "" if delivered else ": kept until it registers",
        )
        return result

    def _deliver_world(self, worker: Worker) -> bool:
        """Give a registered worker the world assigned to its instance, if there is one."""
        req = self._worlds.for_worker(self.job, worker)
        if req is None:
            return False
        if worker.world != (req.attempt, req.env):
            worker.world = (req.attempt, dict(req.env))
            self._changed()
        return True

    def checkpoint(self, rank: int, report: CheckpointReport, key: str | None = None) -> None:
        """Keep a worker's report (forwarded durably before this returns); one sent again
        under a `key` already taken is acknowledged and not kept twice."""
        self.registry.get(rank)
        if key is not None and key in self._report_keys:
            log.info("rank %d sent its report %s again: kept once", rank, key)
            return
        record = CheckpointRecord(rank, report, utcnow().isoformat(), key)
        if self.on_checkpoint is not None:
            self.on_checkpoint(record, self.job)
        if key is not None:
            self._report_keys[key] = None
            if len(self._report_keys) > KEEP_REPORT_KEYS:
                self._report_keys.popitem(last=False)
        self.checkpoints.append(record)
        extra = ""
        if report.bytes is not None:
            extra += f", {report.bytes} bytes"
        if report.total_s is not None:
            extra += f", {report.total_s:.3f}s in all"
        log.info(
            "rank %d %s %s checkpoint of step %d in %.3fs%s",
            rank,
            report.event,
            report.tier,
            report.step,
            report.duration_s,
            extra,
        )

    def release_if_idle(self) -> bool:
        """Become a spare if the job left: True when the node was released now.

        Called by the agent after each poll of the workers. Only a node whose workers all
        registered themselves (the Kubernetes path: none launched by us, the actuator
        releases those), all gone for `idle_release_s`, with a heartbeat carrying their
        final states accepted by the supervisor (so it saw the exits before the workers
        disappear from our heartbeats). A registration meanwhile cancels it.
        """
        workers = list(self.registry.workers.values())
        idle = (
            self.state is NodeState.RUNNING
            and bool(workers)
            and not any(w.alive or w.launched for w in workers)
            and not self._lock.locked()  # a start or stop is under way
        )
        if not idle:
            self._idle_since = None
            return False
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.idle_release_s:
            return False
        if self.wait_for_delivery and self._delivered_version < self._version:
            return False
        log.info(
            "job %s left this node %.1fs ago (%s): released, node is a spare",
            self.job,
            now - self._idle_since,
            ", ".join(f"rank {w.rank} {w.state.value}" for w in sorted(workers, key=_rank)),
        )
        self.registry.forget()
        self.state = NodeState.SPARE
        self.job = None
        self.checkpoint_peer = None
        self._idle_since = None
        self._changed()
        return True

    # --- internals ------------------------------------------------------------------------

    def _job_joined_by(self, reg: WorkerRegistration) -> str | None:
        """The job `reg` moves the node to; None when the node keeps its own."""
        if self.state is NodeState.SPARE:
            if reg.job is None:
                raise WorkerConflict(
                    "job: this node is a spare and serves no job: a registration on it must "
                    f"name its job (worker client: set {ENV_JOB} in the worker's environment)"
                )
            return reg.job
        if reg.job is None or reg.job == self.job:
            return None  # an older client, or a worker we launched: the node's own job
        live = self.registry.live()
        if live:
            raise WorkerConflict(
                f"job: this node runs job {self.job!r} (ranks {[w.rank for w in live]} still "
                f"alive): a worker of job {reg.job!r} cannot register until they are gone"
            )
        return reg.job

    def _changed(self) -> None:
        self._version += 1
        self.on_change()

    def _worker_changed(self, worker: Worker) -> None:
        self._changed()
