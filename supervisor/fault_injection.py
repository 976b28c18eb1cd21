"""Fault injection: faults acted out on request (over REST, off unless enabled), their
schedules and timers, and the records that link what they cause to them.

`heartbeat_loss` acts in the sensor: its fault marks mute the node. GPU errors go
through the node's real watchdogs when the backend runs processes (local mode), else
straight to the sensor. Worker and node faults need a backend that runs processes; the
sensor's fault marks then expect their consequences on the node, so that the events they
cause carry the fault's id. A schedule injects faults until ended, and outlives a
restart of the supervisor: a drill (cron or interval) is a job on the supervisor's
scheduler (supervisor.schedules.drills); a random schedule stays a task of its own,
because its gaps are drawn afresh at each turn (exponential, a Poisson process), which
no trigger of the scheduler states, and its record is all it needs to resume.

What each kind is comes from the protocol's table (`resiliency_protocol.faults.FAULTS`);
what the sensor does for a kind is `FaultInjector.sensor_acts`, what a drill draws for a
kind's required parameters is `DRILL_PARAMS` (tests/test_fault_table.py checks both).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from resiliency_protocol.faults import FAULTS, SENSOR_FAULT_KINDS, FaultKind
from resiliency_protocol.heartbeat import GPU_ECC, GPU_XID, GpuReportKind
from supervisor.actuator import ActionError, Backend
from supervisor.config_parts import SensingSettings
from supervisor.domain import Event, Fault
from supervisor.errors import FaultNotSupported, UnknownTarget
from supervisor.schedules import Scheduler
from supervisor.schedules.drills import RUN_DRILL, Drill, job_id
from supervisor.sensor import Changes, GpuReport, Sensor
from supervisor.store.roles import FaultLedger

log = logging.getLogger(__name__)

#: What a `random` schedule draws from (Google's rank_killed, rank_hung, plus nodes).
RANDOM_KINDS = (FaultKind.WORKER_CRASH, FaultKind.WORKER_HANG, FaultKind.NODE_DOWN)


@dataclass(frozen=True, slots=True)
class FaultRequest:
    """A fault to inject (`kind`), or a schedule of them (`schedule` or `drill`; `kind`
    None)."""

    kind: FaultKind | None
    node: str | None
    job: str | None
    params: dict[str, Any]
    schedule: tuple[str, float] | None = None
    drill: Drill | None = None


#: A drill's turn: the required parameters of a kind that has some, drawn for `node`.
DrillParams = Callable[[Sensor, str, random.Random], dict[str, Any]]


def _drill_xid(sensor: Sensor, node: str, rng: random.Random) -> dict[str, Any]:
    return {"code": rng.choice((43, 48, 63, 74, 79))}


def _drill_ecc(sensor: Sensor, node: str, rng: random.Random) -> dict[str, Any]:
    # ECC counts are cumulative: only a count above the node's last one is new errors
    # (and an event), so every turn of a drill raises one.
    return {"count": sensor.ecc_count(node) + 1}


#: Each drillable kind that has required parameters (tests/test_fault_table.py).
DRILL_PARAMS: Mapping[FaultKind, DrillParams] = {
    FaultKind.XID: _drill_xid,
    FaultKind.ECC: _drill_ecc,
}


#: Acts a fault out in the sensor alone: the fault (ended if it is over) and its events.
SensorAct = Callable[
    ["FaultInjector", str, Mapping[str, Any], Fault], Awaitable[tuple[Fault, list[Event]]]
]


class FaultHost(Protocol):
    """What fault injection needs of the supervisor it runs in."""

    sensor: Sensor
    backend: Backend
    #: The acting supervisor's scheduler; None until it starts.
    scheduler: Scheduler | None

    #: Its sensing settings (the whole settings hold them): a fault's window.
    @property
    def settings(self) -> SensingSettings: ...

    @property
    def store(self) -> FaultLedger: ...

    async def record(self, changes: Changes) -> list[Event]: ...


class FaultInjector:
    def __init__(self, host: FaultHost) -> None:
        self._host = host
        self._fault_timers: dict[int, asyncio.TimerHandle] = {}
        self._schedules: dict[int, asyncio.Task[None]] = {}
        #: Per schedule, the injection under way (ending the schedule waits for it).
        self._injecting: dict[int, asyncio.Future[bool]] = {}

    @property
    def sensing(self) -> SensingSettings:
        """What the fault's window is judged by."""
        return SensingSettings.of(self._host.settings)

    @property
    def sensor(self) -> Sensor:
        return self._host.sensor

    @property
    def backend(self) -> Backend:
        return self._host.backend

    @property
    def store(self) -> FaultLedger:
        return self._host.store

    async def record(self, changes: Changes) -> list[Event]:
        return await self._host.record(changes)

    def close(self) -> None:
        """Stop the timers and schedules (the supervisor stops; schedules resume later)."""
        for timer in self._fault_timers.values():
            timer.cancel()
        for schedule in self._schedules.values():
            schedule.cancel()

    async def inject(self, request: FaultRequest) -> tuple[Fault, list[Event]]:
        """Inject a fault; the events it causes, and the actions taken, carry its id.

        `heartbeat_loss` acts in the sensor. GPU errors go through the node's real
        watchdogs when the backend runs processes (local mode), else straight to the
        sensor. Worker and node faults need a backend that runs processes.
        """
        if request.kind is None or request.schedule is not None or request.drill is not None:
            return await self._start_schedule(request), []
        kind = request.kind
        if request.node is None or not self.sensor.has_node(request.node):
            raise UnknownTarget(f"node {request.node!r} is not known")
        node = request.node
        through_backend = kind in self.backend.process_faults
        sensor_act = self.sensor_acts.get(kind)
        if not through_backend and sensor_act is None:
            raise FaultNotSupported(
                f"kind: {kind} faults need a backend that runs processes "
                f"(backend {self.backend.name!r} does not)"
            )
        fault = await asyncio.to_thread(
            lambda: self.store.create_fault(
                kind.value, node=node, job=request.job, params=request.params
            )
        )
        if through_backend:
            return await self._through_backend(kind, node, request.params, fault), []
        assert sensor_act is not None
        return await sensor_act(self, node, request.params, fault)

    async def _through_backend(
        self, kind: FaultKind, node: str, params: Mapping[str, Any], fault: Fault
    ) -> Fault:
        """Act the fault out on the node's processes; its consequences, expected within a
        window, carry its id."""
        # Expect the consequences within a detection period or two, plus slack.
        window = 2 * self.sensing.heartbeat_timeout_s + 30
        one_shot = FAULTS[kind].one_shot
        if not one_shot:  # a straggler: seen once it stayed slow for a window or so,
            window += 2 * self.sensing.straggler_window_s
            # and what it causes while it lasts (a hang, a restart) is its doing too
            window += float(params.get("duration_s") or 0)
        self.sensor.fault_marks.expect(node, fault.id, window)
        # `schedule` links the fault record to its schedule; the node is told only
        # what the kind itself takes (its host monitor refuses anything else).
        own = {k: v for k, v in params.items() if k != "schedule"}
        try:
            await self.backend.inject_fault(kind, node, own)
        except ActionError as exc:
            self.sensor.fault_marks.withdraw(fault.id)
            await self.end(fault.id)
            raise FaultNotSupported(f"{kind} on {node}: {exc}") from None
        if one_shot:
            return await self._acted_out(fault)
        duration = params.get("duration_s")
        if duration is not None:  # over when the node stops acting it out
            loop = asyncio.get_running_loop()
            self._fault_timers[fault.id] = loop.call_later(
                duration, lambda: asyncio.ensure_future(self._acted_out(fault))
            )
        return fault

    # --- what the sensor acts out by itself (`sensor_acts`) --------------------------------

    async def _mute(
        self, node: str, params: Mapping[str, Any], fault: Fault
    ) -> tuple[Fault, list[Event]]:
        """A heartbeat loss: the node's heartbeats are dropped (for `duration_s`)."""
        duration = params.get("duration_s")
        self.sensor.fault_marks.mute(node, fault.id, duration)
        if duration is not None:
            loop = asyncio.get_running_loop()
            self._fault_timers[fault.id] = loop.call_later(
                duration, lambda: asyncio.ensure_future(self.end(fault.id))
            )
        return fault, []

    async def _xid(
        self, node: str, params: Mapping[str, Any], fault: Fault
    ) -> tuple[Fault, list[Event]]:
        return await self._gpu_report(GPU_XID, node, params, fault)

    async def _ecc(
        self, node: str, params: Mapping[str, Any], fault: Fault
    ) -> tuple[Fault, list[Event]]:
        return await self._gpu_report(GPU_ECC, node, params, fault)

    async def _gpu_report(
        self, kind: GpuReportKind, node: str, params: Mapping[str, Any], fault: Fault
    ) -> tuple[Fault, list[Event]]:
        """A GPU error reported straight to the sensor, as the node's watchdog would."""
        report = GpuReport(
            kind=kind,
            gpu=params.get("gpu"),
            code=params.get("code"),
            count=params.get("count"),
            message=f"injected by fault {fault.id}",
        )
        changes = self.sensor.inject_gpu_report(node, report, fault.id)
        # Ended before its events go to the policy: the answer then waits for nothing
        # the policy does.
        fault = await self._acted_out(fault)
        events = await self.record(changes) if changes else []
        return fault, events

    #: Each kind the sensor acts out by itself (`through_sensor` in the protocol's table).
    sensor_acts: ClassVar[Mapping[FaultKind, SensorAct]] = {
        FaultKind.HEARTBEAT_LOSS: _mute,
        FaultKind.XID: _xid,
        FaultKind.ECC: _ecc,
    }

    async def _acted_out(self, fault: Fault) -> Fault:
        """A fault that has happened is over (ended, no longer `active`); what it causes
        later, within its window, still carries its id."""
        self._fault_timers.pop(fault.id, None)
        ended = await asyncio.to_thread(self.store.end_fault, fault.id)
        return ended if ended is not None else fault

    async def _start_schedule(self, request: FaultRequest) -> Fault:
        """A drill on the scheduler, or faults at random (exponential gaps of the given
        mean) until ended."""
        if request.drill is not None:
            kinds = request.drill.kinds
        else:
            assert request.schedule is not None
            kind, mean_s = request.schedule
            kinds = RANDOM_KINDS if kind == "random" else (kind,)
        takes = self.backend.process_faults | SENSOR_FAULT_KINDS
        unsupported = [k for k in kinds if k not in takes]
        if unsupported:
            raise FaultNotSupported(f"schedule: {unsupported[0]} faults need the local backend")
        if request.job is not None and not self.sensor.has_job(request.job):
            raise UnknownTarget(f"job {request.job!r} is not known")
        scheduler = self._host.scheduler
        if request.drill is not None and scheduler is None:
            raise FaultNotSupported("schedule: the scheduler is not running (not acting)")
        fault = await asyncio.to_thread(
            lambda: self.store.create_fault(
                "schedule", node=None, job=request.job, params=request.params
            )
        )
        if request.drill is not None:
            assert scheduler is not None
            try:
                job = await asyncio.to_thread(
                    scheduler.add,
                    job_id(fault.id),
                    RUN_DRILL,
                    request.drill.trigger(),
                    {"fault": fault.id},
                )
            except BaseException:
                await asyncio.to_thread(self.store.end_fault, fault.id)
                raise
            log.info("drill %s scheduled: next run %s", fault.id, job.next_run_time)
            return fault
        self._schedules[fault.id] = asyncio.create_task(
            self._run_schedule(fault.id, kinds, mean_s, request.job), name=f"faults:{fault.id}"
        )
        return fault

    async def drill_turn(self, fault_id: int) -> None:
        """One run of a drill: one fault of its kinds on a node of its job (or any)."""
        fault = await asyncio.to_thread(self.store.get_fault, fault_id)
        scheduler = self._host.scheduler
        if fault is None or not fault.active:
            if scheduler is not None:  # ended while its job was still stored
                await asyncio.to_thread(scheduler.remove, job_id(fault_id))
            return
        kinds = tuple(fault.params["schedule"]["kinds"])
        if not await self._inject_one(fault_id, kinds, fault.job, random.Random()):
            log.warning("drill %s found no live node to inject into", fault_id)

    async def resume(self) -> None:
        """Fault schedules outlive a restart of the supervisor, like the faults they cause."""
        for fault in await asyncio.to_thread(self.store.list_faults, True):
            schedule = fault.params.get("schedule")
            if fault.kind != "schedule" or not isinstance(schedule, str):
                continue  # a drill's job is in the scheduler's store
            kind, _, mean = schedule.partition(",")
            if not mean:
                continue
            kinds = RANDOM_KINDS if kind == "random" else (kind,)
            self._schedules[fault.id] = asyncio.create_task(
                self._run_schedule(fault.id, kinds, float(mean), fault.job),
                name=f"faults:{fault.id}",
            )

    async def _run_schedule(
        self, parent: int, kinds: tuple[str, ...], mean_s: float, job: str | None
    ) -> None:
        rng = random.Random()
        while True:
            await asyncio.sleep(rng.expovariate(1.0 / mean_s))
            # Shielded: a schedule ended mid-injection finishes that fault before its end is
            # answered (`end` waits), rather than write it afterwards from a store thread.
            injecting = asyncio.ensure_future(self._inject_one(parent, kinds, job, rng))
            self._injecting[parent] = injecting
            await asyncio.shield(injecting)
            self._injecting.pop(parent, None)

    async def _inject_one(
        self, parent: int, kinds: tuple[str, ...], job: str | None, rng: random.Random
    ) -> bool:
        """One fault of `kinds` on a live node of `job` (or any job), linked to the
        schedule `parent`; False when no node could take one."""
        nodes, _ = self.sensor.snapshot()
        targets = sorted(
            n.name
            for n in nodes.values()
            if n.alive and n.job is not None and (job is None or n.job == job)
        )
        if not targets:
            return False
        name = rng.choice(kinds)
        node = rng.choice(targets)
        if name not in FAULTS:  # stored by a version that knew other kinds
            log.warning("schedule %s could not inject %s: no such fault kind", parent, name)
            return False
        kind = FaultKind(name)
        draw = DRILL_PARAMS.get(kind)
        params: dict[str, Any] = {"schedule": parent}
        if draw is not None:
            params.update(draw(self.sensor, node, rng))
        try:
            await self.inject(FaultRequest(kind, node, nodes[node].job, params))
            log.info("schedule %s injected %s on %s", parent, kind, node)
        except (FaultNotSupported, UnknownTarget) as exc:
            log.warning("schedule %s could not inject %s on %s: %s", parent, name, node, exc)
            return False
        return True

    async def end(self, fault_id: int) -> Fault | None:
        """End a fault (a schedule stops; a heartbeat loss is over); ended already: as is."""
        schedule = self._schedules.pop(fault_id, None)
        if schedule is not None:
            schedule.cancel()
            injecting = self._injecting.pop(fault_id, None)
            if injecting is not None:
                await asyncio.wait({injecting})
        if self._host.scheduler is not None:
            await asyncio.to_thread(self._host.scheduler.remove, job_id(fault_id))
        timer = self._fault_timers.pop(fault_id, None)
        if timer is not None:
            timer.cancel()
        self.sensor.fault_marks.end(fault_id)
        return await asyncio.to_thread(self.store.end_fault, fault_id)
