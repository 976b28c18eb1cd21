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
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

from resiliency_protocol.faults import FaultKind
from supervisor.actuator import ActionError, Backend
from supervisor.config import Settings
from supervisor.domain import Event, Fault
from supervisor.errors import FaultNotSupported, UnknownTarget
from supervisor.schedules import Scheduler
from supervisor.schedules.drills import RUN_DRILL, Drill, job_id
from supervisor.sensor import Changes, GpuReport, Sensor
from supervisor.store import Store

log = logging.getLogger(__name__)

#: Faults the sensor can act out by itself, with any backend.
SENSOR_FAULTS = frozenset({FaultKind.HEARTBEAT_LOSS, FaultKind.XID, FaultKind.ECC})
#: Faults that happen once (a kill, a signal, a GPU error): over as soon as acted out.
ONE_SHOT_FAULTS = frozenset(
    {
        FaultKind.NODE_DOWN,
        FaultKind.WORKER_CRASH,
        FaultKind.WORKER_HANG,
        FaultKind.XID,
        FaultKind.ECC,
    }
)

#: What a `random` schedule draws from (Google's rank_killed, rank_hung, plus nodes).
RANDOM_KINDS = (FaultKind.WORKER_CRASH, FaultKind.WORKER_HANG, FaultKind.NODE_DOWN)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    node: str | None
    job: str | None
    params: dict[str, Any]
    schedule: tuple[str, float] | None = None
    drill: Drill | None = None


class FaultHost(Protocol):
    """What fault injection needs of the supervisor it runs in."""

    settings: Settings
    sensor: Sensor
    backend: Backend
    #: The acting supervisor's scheduler; None until it starts.
    scheduler: Scheduler | None

    @property
    def store(self) -> Store: ...

    async def record(self, changes: Changes) -> list[Event]: ...


class FaultInjector:
    def __init__(self, host: FaultHost) -> None:
        self._host = host
        self._fault_timers: dict[int, asyncio.TimerHandle] = {}
        self._schedules: dict[int, asyncio.Task[None]] = {}

    @property
    def settings(self) -> Settings:
        return self._host.settings

    @property
    def sensor(self) -> Sensor:
        return self._host.sensor

    @property
    def backend(self) -> Backend:
        return self._host.backend

    @property
    def store(self) -> Store:
        return self._host.store

    async def record(self, changes: Changes) -> list[Event]:
        return await self._host.record(changes)

    def close(self) -> None:
        """Stop the timers and schedules (the supervisor stops; schedules resume later)."""
        for timer in self._fault_timers.values():
            timer.cancel()
        for schedule in self._schedules.values():
            schedule.cancel()

    async def inject(self, spec: FaultSpec) -> tuple[Fault, list[Event]]:
        """Inject a fault; the events it causes, and the actions taken, carry its id.

        `heartbeat_loss` acts in the sensor. GPU errors go through the node's real
        watchdogs when the backend runs processes (local mode), else straight to the
        sensor. Worker and node faults need a backend that runs processes.
        """
        if spec.schedule is not None or spec.drill is not None:
            return await self._start_schedule(spec), []
        if spec.node is None or not self.sensor.has_node(spec.node):
            raise UnknownTarget(f"node {spec.node!r} is not known")
        through_backend = spec.kind in self.backend.process_faults
        if not through_backend and spec.kind not in SENSOR_FAULTS:
            raise FaultNotSupported(
                f"kind: {spec.kind} faults need a backend that runs processes "
                f"(backend {self.backend.name!r} does not)"
            )
        fault = await asyncio.to_thread(
            lambda: self.store.create_fault(
                spec.kind, node=spec.node, job=spec.job, params=spec.params
            )
        )
        if through_backend:
            # Expect the consequences within a detection period or two, plus slack.
            window = 2 * self.settings.heartbeat_timeout_s + 30
            if spec.kind == FaultKind.STRAGGLER:  # seen once it stayed slow for a window or so
                window += 2 * self.settings.straggler_window_s
                # and what it causes while it lasts (a hang, a restart) is its doing too
                window += float(spec.params.get("duration_s") or 0)
            self.sensor.fault_marks.expect(spec.node, fault.id, window)
            # `schedule` links the fault record to its schedule; the node is told only
            # what the kind itself takes (its host monitor refuses anything else).
            own = {k: v for k, v in spec.params.items() if k != "schedule"}
            try:
                await self.backend.inject_fault(spec.kind, spec.node, own)
            except ActionError as exc:
                self.sensor.fault_marks.withdraw(fault.id)
                await self.end(fault.id)
                raise FaultNotSupported(f"{spec.kind} on {spec.node}: {exc}") from None
            if spec.kind in ONE_SHOT_FAULTS:
                return await self._acted_out(fault), []
            duration = spec.params.get("duration_s")
            if duration is not None:  # a straggler: over when the node stops slowing it
                loop = asyncio.get_running_loop()
                self._fault_timers[fault.id] = loop.call_later(
                    duration, lambda: asyncio.ensure_future(self._acted_out(fault))
                )
            return fault, []
        if spec.kind == FaultKind.HEARTBEAT_LOSS:
            duration = spec.params.get("duration_s")
            self.sensor.fault_marks.mute(spec.node, fault.id, duration)
            if duration is not None:
                loop = asyncio.get_running_loop()
                self._fault_timers[fault.id] = loop.call_later(
                    duration, lambda: asyncio.ensure_future(self.end(fault.id))
                )
            return fault, []
        report = GpuReport(
            kind="xid" if spec.kind == FaultKind.XID else "ecc",  # the GPU report's kinds
            gpu=spec.params.get("gpu"),
            code=spec.params.get("code"),
            count=spec.params.get("count"),
            message=f"injected by fault {fault.id}",
        )
        changes = self.sensor.inject_gpu_report(spec.node, report, fault.id)
        # Ended before its events go to the policy: the answer then waits for nothing
        # the policy does.
        fault = await self._acted_out(fault)
        events = await self.record(changes) if changes else []
        return fault, events

    async def _acted_out(self, fault: Fault) -> Fault:
        """A fault that has happened is over (ended, no longer `active`); what it causes
        later, within its window, still carries its id."""
        self._fault_timers.pop(fault.id, None)
        ended = await asyncio.to_thread(self.store.end_fault, fault.id)
        return ended if ended is not None else fault

    async def _start_schedule(self, spec: FaultSpec) -> Fault:
        """A drill on the scheduler, or faults at random (exponential gaps of the given
        mean) until ended."""
        if spec.drill is not None:
            kinds = spec.drill.kinds
        else:
            assert spec.schedule is not None
            kind, mean_s = spec.schedule
            kinds = RANDOM_KINDS if kind == "random" else (kind,)
        unsupported = [k for k in kinds if k not in self.backend.process_faults | SENSOR_FAULTS]
        if unsupported:
            raise FaultNotSupported(f"schedule: {unsupported[0]} faults need the local backend")
        if spec.job is not None and not self.sensor.has_job(spec.job):
            raise UnknownTarget(f"job {spec.job!r} is not known")
        scheduler = self._host.scheduler
        if spec.drill is not None and scheduler is None:
            raise FaultNotSupported("schedule: the scheduler is not running (not acting)")
        fault = await asyncio.to_thread(
            lambda: self.store.create_fault("schedule", node=None, job=spec.job, params=spec.params)
        )
        if spec.drill is not None:
            assert scheduler is not None
            try:
                job = await asyncio.to_thread(
                    scheduler.add,
                    job_id(fault.id),
                    RUN_DRILL,
                    spec.drill.trigger(),
                    {"fault": fault.id},
                )
            except BaseException:
                await asyncio.to_thread(self.store.end_fault, fault.id)
                raise
            log.info("drill %s scheduled: next run %s", fault.id, job.next_run_time)
            return fault
        self._schedules[fault.id] = asyncio.create_task(
            self._run_schedule(fault.id, kinds, mean_s, spec.job), name=f"faults:{fault.id}"
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
            await self._inject_one(parent, kinds, job, rng)

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
        kind = rng.choice(kinds)
        node = rng.choice(targets)
        params: dict[str, Any] = {"schedule": parent}
        if kind == "xid":
            params["code"] = rng.choice((43, 48, 63, 74, 79))
        elif kind == "ecc":
            # ECC counts are cumulative: only a count above the node's last one is new
            # errors (and an event), so every turn of a drill raises one.
            params["count"] = self.sensor.ecc_count(node) + 1
        try:
            await self.inject(FaultSpec(kind, node, nodes[node].job, params))
            log.info("schedule %s injected %s on %s", parent, kind, node)
        except (FaultNotSupported, UnknownTarget) as exc:
            log.warning("schedule %s could not inject %s on %s: %s", parent, kind, node, exc)
            return False
        return True

    async def end(self, fault_id: int) -> Fault | None:
        """End a fault (a schedule stops; a heartbeat loss is over); ended already: as is."""
        schedule = self._schedules.pop(fault_id, None)
        if schedule is not None:
            schedule.cancel()
        if self._host.scheduler is not None:
            await asyncio.to_thread(self._host.scheduler.remove, job_id(fault_id))
        timer = self._fault_timers.pop(fault_id, None)
        if timer is not None:
            timer.cancel()
        self.sensor.fault_marks.end(fault_id)
        return await asyncio.to_thread(self.store.end_fault, fault_id)
