"""Wires the parts together: sensor -> store -> controller -> actuator -> backend.

Rules kept here:
- an event is in the database before anyone is told about it (the API's ack, the policy);
- timer-driven sensor changes are persisted in the order they happened;
- on start, the picture, unfinished actions and unhandled events are taken back, so a
  restart loses nothing and repeats nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from socket import gethostname
from typing import Any

from resiliency_protocol.backoff import Backoff
from supervisor.action_effects import apply_effects
from supervisor.action_params import InvalidParams, ScaleDownParams, ScaleUpParams, check_params
from supervisor.actuator import (
    Actuator,
    Backend,
    BackendHooks,
    DryRunBackend,
    Fence,
    no_fence,
)
from supervisor.config import Settings
from supervisor.config_parts import SensingSettings, WorkloadSettings
from supervisor.controller import Controller, load_policy
from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    ActionType,
    Event,
    Fault,
    JobView,
    NodeState,
    NodeView,
)
from supervisor.errors import RequestRefused, UnknownTarget
from supervisor.fault_injection import FaultInjector, FaultRequest
from supervisor.live_hub import Hub
from supervisor.metrics import Metrics
from supervisor.notifications.delivery import Notifier
from supervisor.policy import Policy
from supervisor.pruner import HistoryPruner
from supervisor.remedies import RemediesInFlight
from supervisor.schedules import Scheduler
from supervisor.schedules.periodic import PeriodicWork
from supervisor.sensor import Changes, Sensor
from supervisor.sensor.worlds import WorldFence
from supervisor.store import UNAVAILABLE, Store, open_store

log = logging.getLogger(__name__)


def make_backend(settings: Settings) -> Backend:
    if settings.dry_run and settings.backend == "kubernetes":
        # Sensing stays on: the cluster is watched (read only) as the acting supervisor
        # watches it, and no action reaches it.
        from supervisor.kube.backend import KubeBackend

        return DryRunBackend(watching=KubeBackend(settings, read_only=True))
    if settings.dry_run or settings.backend == "dry_run":
        return DryRunBackend()
    if settings.backend == "kubernetes":
        from supervisor.kube.backend import KubeBackend  # the only user of the client

        return KubeBackend(settings)
    from supervisor.local.backend import LocalBackend  # only local mode needs it

    return LocalBackend(Path(settings.local_run_dir), settings)


#: Builds the sensor from the settings, the callback for its timers' changes and the
#: metrics (the simulator passes one told by its simulated cluster).
SensorFactory = Callable[
    [SensingSettings, WorkloadSettings, Callable[[Changes], None], Metrics], Sensor
]


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        *,
        backend: Backend | None = None,
        policy: Policy | None = None,
        sensor: SensorFactory | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        #: Live readers (the dashboard's stream) hear of every event and action change.
        self.hub = Hub()
        self.policy = policy or load_policy(settings.policy)
        self.backend = backend or make_backend(settings)
        #: Nothing is carried out: `dry_run: true`, or a backend that acts on nothing.
        self.dry_run = settings.dry_run or self.backend.dry_run
        self.sensor = (sensor or Sensor)(
            settings.sensing, settings.workload, self._on_timer_changes, self.metrics
        )
        #: Each job's newest world: reports from older ones are refused.
        self.worlds = WorldFence(self.metrics)
        self.backend.follow_worlds(self.worlds.started)
        #: Each job's remedies in flight (a job with one is recovering).
        self.remedies = RemediesInFlight()
        self._store: Store | None = None
        self._actuator: Actuator | None = None
        self._controller: Controller | None = None
        #: Changes to record, in order, retried while the database is unavailable.
        self._pending: asyncio.Queue[Changes] = asyncio.Queue()
        self._backlog = 0  # put on _pending and not recorded yet
        #: A write failed for want of the database, and what waits since is not written
        #: yet: heartbeats' changes then wait behind it, in order.
        self._database_down = False
        self._recorder: asyncio.Task[None] | None = None
        #: Fault injection (off unless enabled): faults, their schedules and timers.
        self.faults = FaultInjector(self)
        #: The scheduler, the sampler and retention (while acting).
        self._periodic: PeriodicWork | None = None
        self.scheduler: Scheduler | None = None
        #: Deletes history past its retention; None when all of it is kept forever.
        self.pruner: HistoryPruner | None = None
        #: Sends events and finished actions to the notification routes (if any).
        self.notifier: Notifier | None = None
        #: Raises Fenced once this replica may no longer act; leader election sets it.
        self.fence: Fence = no_fence
        self.ready = False
        #: The epoch this supervisor acts in, once started (None: a dry run, or not yet).
        self.leader_epoch: int | None = None
        #: What /readyz and refused requests answer while not ready (a standby says who
        #: leads; see supervisor.kube.leader).
        self.readiness: dict[str, Any] = {"status": "starting", "detail": "starting up"}

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("supervisor not started")
        return self._store

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("supervisor not started")
        return self._controller

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        self._store = await asyncio.to_thread(
            open_store, self.settings.database_url, dry_run=self.dry_run
        )
        if not self.dry_run:  # before anything acts (resiliency_protocol/leaders.py)
            holder = self.settings.leader_election_identity or f"{gethostname()}:{os.getpid()}"
            self.leader_epoch = await asyncio.to_thread(self.store.take_leader_epoch, holder)
        self.backend.act_in_epoch(self.leader_epoch)
        # Listening before anything is published: resumed actions finish and notify too.
        self.notifier = Notifier(self.settings.notifications, self.store, self.hub, self.metrics)
        await self.notifier.start()
        self._actuator = Actuator(
            self.store,
            self.backend,
            self.settings.actuator,
            self.metrics,
            self._apply_effects,
            on_change=self._action_changed,
            fence=self.fence,
        )
        self._controller = Controller(
            self.settings.remediation,
            self.policy,
            self.store,
            self._actuator,
            self._snapshot,
            self.metrics,
            incident_lag_s=(
                self.settings.heartbeat_timeout_s + self.settings.heartbeat_polling_period_s
            ),
            raise_event=lambda event: self._hold(Changes(events=[event])),
        )
        nodes, jobs = await asyncio.gather(
            asyncio.to_thread(self.store.load_nodes), asyncio.to_thread(self.store.load_jobs)
        )
        self.sensor.restore(nodes, jobs)
        await self.controller.restore(self.leader_epoch)  # budgets, give-ups, incidents
        unfinished = await asyncio.to_thread(self.store.unfinished_actions)
        unhandled = await asyncio.to_thread(self.store.unhandled_events)
        if unfinished or unhandled:
            log.info(
                "resuming %d unfinished actions and %d unhandled events",
                len(unfinished),
                len(unhandled),
            )
        self.controller.submit_actions(unfinished)
        for event in unhandled:
            self.controller.submit_event(event)
        self._recorder = asyncio.create_task(self._record_timer_changes(), name="recorder")
        # Acting only (a standby never gets here): drills, windows, retention, sampling.
        self._periodic = PeriodicWork(
            self.settings, self.store, self.metrics, self.sensor.job_steps, dry_run=self.dry_run
        )
        self.pruner = self._periodic.pruner
        await self.faults.resume()
        await self.backend.start(
            BackendHooks(
                raise_events=self._raise_backend_events,
                request_action=self._request_backend_action,
                node_address=self._node_address,
                node_heartbeating=self._node_heartbeating,
                event=self._event,
                fence=self.fence,
            )
        )
        self.ready = True
        # Once acting: a stored job due now runs as the acting supervisor it is.
        self._periodic.start(self)
        self.scheduler = self._periodic.scheduler
        self.metrics.acting.set(1)
        log.info(
            "supervisor ready: %d nodes, %d jobs, policy %s, backend %s",
            len(nodes),
            len(jobs),
            type(self.policy).__name__,
            self.backend.name,
        )

    async def stop(self) -> None:
        self.ready = False
        self.hub.close()
        self.metrics.acting.set(0)
        self.readiness = {"status": "stopping", "detail": "the supervisor is stopping"}
        self.sensor.close()
        self.faults.close()
        if self._recorder is not None:
            self._recorder.cancel()
            await asyncio.gather(self._recorder, return_exceptions=True)
        if self._periodic is not None:
            self.scheduler = None
            await self._periodic.stop()
        if self._controller is not None:
            await self._controller.close()
        if self.notifier is not None:
            await self.notifier.stop()
        await self.backend.close()
        if self._store is not None:
            self._store.close()

    # --- leadership (supervisor.kube.leader.LeaderRuntime) ------------------------------

    def set_fence(self, fence: Fence) -> None:
        """Before `start`: the actuator and the backend check `fence` before acting."""
        self.fence = fence

    def stand_by(self, identity: str, leader: str | None, detail: str) -> None:
        """What /readyz answers while this replica waits for the Lease."""
        self.readiness = {
            "status": "standby",
            "identity": identity,
            "leader": leader,
            "detail": detail,
        }

    def step_down(self, reason: str) -> None:
        """This replica lost the Lease: not ready, not acting, from now on."""
        self.ready = False
        self.metrics.acting.set(0)
        self.readiness = {"status": "lost leadership", "detail": reason}

    async def settle(self) -> None:
        """Wait until recorded changes are persisted and their handling is done, the
        events that handling raised (a job given up, a spare again) included: they are
        held while the controller drains, so one pass is not enough."""
        while True:
            await self._pending.join()
            await self.controller.drain()
            if not self._backlog and self.controller.idle:
                return

    # --- sensor input ---------------------------------------------------------------------

    async def record_or_hold(self, changes: Changes) -> list[Event] | None:
        """Record a heartbeat's changes; None when they could not be recorded now (the
        database is unavailable, or earlier changes still wait for it): they are held
        in memory and recorded after those, in order, once it answers. Not acknowledged
        then: the sensor has taken them in, so they are not raised again."""
        if self._database_down:
            self._hold(changes)
            return None
        try:
            return await self.record(changes)
        except UNAVAILABLE:
            log.warning("database unavailable: holding a heartbeat's changes in memory")
            self._database_down = True
            self._hold(changes)
            return None

    def _hold(self, changes: Changes) -> None:
        self._backlog += 1
        self._pending.put_nowait(changes)

    async def record(self, changes: Changes) -> list[Event]:
        """Persist what a sensor step produced, then hand its events to the controller."""
        events = await asyncio.to_thread(
            self.store.record, changes.events, changes.nodes, changes.jobs
        )
        for event in events:
            self.hub.event(event)
            self.controller.submit_event(event)
        return events

    # --- backends that watch the cluster (Kubernetes) ---------------------------------------

    def _snapshot(self) -> tuple[dict[str, NodeView], dict[str, JobView]]:
        """The sensor's picture, with what the backend reads from the cluster in place of
        the settings' defaults: replicas and bounds (e.g. JobSet annotations), and which
        nodes run the job's pods (a swapped-out node's heartbeats said so last), which
        nodes are cordoned and which are spares."""
        nodes, jobs = self.sensor.snapshot()
        for name, seen in self.backend.job_views().items():
            known = jobs.get(name)
            jobs[name] = (
                seen
                if known is None
                else replace(
                    known,
                    num_dp_replicas=seen.num_dp_replicas,
                    min_num_dp_replicas=seen.min_num_dp_replicas,
                    max_num_dp_replicas=seen.max_num_dp_replicas,
                    num_nodes_per_dp=seen.num_nodes_per_dp,
                    nodes=seen.nodes,
                )
            )
        # The cluster says which nodes are cordoned and which run no workload. A spare
        # must also be known to the sensor and alive: without a heartbeating host monitor
        # it has no health signal and no emergency checkpoint, so none is invented. A node
        # the cluster has placed a pod on is no spare, even before that pod's workers
        # tell its host monitor (a JobSet just recreated by a scale takes its old nodes).
        for name, node in self.backend.cluster_nodes().items():
            view = nodes.get(name)
            if view is None:
                continue
            if node.spare and view.alive:
                view = replace(view, state=NodeState.SPARE, job=None, workers=())
            elif view.state is NodeState.SPARE and not node.cordoned:
                view = replace(view, state=NodeState.UNDEFINED)
            nodes[name] = replace(view, cordoned=node.cordoned)
        return nodes, jobs

    def raise_events(self, events: list[Event]) -> None:
        """Events raised outside the sensor (a backend's watchers, a worker's failed
        checkpoint): the sensor's timers' path, persisted in order (retried while the
        database is down), then given to the controller."""
        self._hold(Changes(events=list(events)))

    def _raise_backend_events(self, events: list[Event]) -> None:
        self.raise_events(events)

    async def _request_backend_action(self, request: ActionRequest, key: str) -> None:
        await self.request_actions([(request, key)], self.backend.name)

    async def request_actions(
        self, requests: list[tuple[ActionRequest, str]], source: str
    ) -> list[ActionRecord]:
        """Record actions (idempotent by key) and queue the new ones, in order, on their
        jobs' lanes: a backend's requests, a maintenance window's steps."""

        def create() -> list[tuple[ActionRecord, bool]]:
            return [self.store.create_action(r, key=key, source=source) for r, key in requests]

        made = await asyncio.to_thread(create)
        new = [action for action, created in made if created]
        for action in new:
            self.hub.action(action)
        self.controller.submit_actions(new)
        return [action for action, _ in made]

    def node_job(self, node: str) -> str | None:
        view = self.sensor.node_view(node)
        return view.job if view is not None else None

    def _node_address(self, name: str) -> str | None:
        return self.sensor.node_address(name)

    async def _event(self, event_id: int) -> Event | None:
        return await asyncio.to_thread(self.store.get_event, event_id)

    def _node_heartbeating(self, name: str) -> bool | None:
        view = self.sensor.node_view(name)
        return view.alive if view is not None else None

    def _on_timer_changes(self, changes: Changes) -> None:
        self._hold(changes)

    async def _record_timer_changes(self) -> None:
        while True:
            batch = [await self._pending.get()]
            # Whatever else is waiting goes in the same transaction: when a rack or the
            # network fails, hundreds of nodes are lost within one timeout, and one commit
            # (an fsync on SQLite) each would hand the last of them to the policy seconds
            # late.
            while not self._pending.empty():
                batch.append(self._pending.get_nowait())
            try:
                await self._record_with_retry(Changes.merged(batch))
            finally:
                self._backlog -= len(batch)
                for _ in batch:
                    self._pending.task_done()
            if not self._backlog:
                self._database_down = False  # everything held is written: in order

    async def _record_with_retry(self, changes: Changes) -> None:
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                await self.record(changes)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The database is down: keep the events in memory and try again; they
                # were never acknowledged to anyone, so nothing is lost by waiting.
                if isinstance(exc, UNAVAILABLE):
                    self._database_down = True
                if backoff.fresh or not isinstance(exc, UNAVAILABLE):
                    log.exception("cannot persist %d events; retrying", len(changes.events))
                await asyncio.sleep(backoff.next())

    # --- effects of finished actions --------------------------------------------------------

    def _action_changed(self, action: ActionRecord) -> None:
        self.remedies.note(action)
        self.hub.action(action)
        if action.type is ActionType.HOT_SWAP and action.node and not action.status.finished:
            # The backend takes the node out of service as the swap starts; its host
            # monitor may report it idle before the swap ends, and it is no spare.
            cordoned = self.sensor.set_cordoned(action.node, True)
            if cordoned:
                self._hold(cordoned)

    async def _apply_effects(self, action: ActionRecord) -> None:
        """Keep the sensor's picture in step with what the backend changed."""
        changed = apply_effects(self.sensor, action)
        if changed.nodes or changed.jobs:
            await asyncio.to_thread(self.store.record, [], changed.nodes, changed.jobs)
        if changed.events:  # a spare again: its own path, persisted then to the policy
            self._hold(Changes(events=changed.events))

    # --- operator requests ----------------------------------------------------------------

    async def request_action(self, request: ActionRequest, key: str) -> tuple[ActionRecord, bool]:
        """Record an operator's action and queue it on its job's lane. Idempotent by key."""
        if request.node and not self.sensor.has_node(request.node):
            raise UnknownTarget(f"node {request.node!r} is not known")
        if request.job and not self.sensor.has_job(request.job):
            raise UnknownTarget(f"job {request.job!r} is not known")
        view = self.sensor.job_view(request.job) if request.job else None
        try:
            params = check_params(request.type, request.params)
        except InvalidParams as exc:  # the API checked them already; other callers may not
            raise RequestRefused(str(exc)) from None
        if isinstance(params, ScaleDownParams | ScaleUpParams) and view is not None:
            to, low, high = params.to_replicas, view.min_num_dp_replicas, view.max_num_dp_replicas
            if not low <= to <= high:
                raise RequestRefused(
                    f"params.to_replicas: {to} is outside job {view.name!r}'s bounds "
                    f"[{low}, {high}] (min_num_dp_replicas, max_num_dp_replicas)"
                )
        action, created = await asyncio.to_thread(
            lambda: self.store.create_action(request, key=f"operator-{key}", source="operator")
        )
        asked = (request.type, request.job, request.node, dict(request.params), request.reason)
        if (
            not created
            and (action.type, action.job, action.node, dict(action.params), action.reason) != asked
        ):
            raise RequestRefused(
                f"Idempotency-Key: already used for another request (action {action.id})"
            )
        if created:
            self.hub.action(action)
            self.controller.submit_actions([action])
        return action, created

    async def inject_fault(self, request: FaultRequest) -> tuple[Fault, list[Event]]:
        """Inject a fault (see `supervisor.fault_injection.FaultInjector.inject`)."""
        return await self.faults.inject(request)

    async def end_fault(self, fault_id: int) -> Fault | None:
        return await self.faults.end(fault_id)
