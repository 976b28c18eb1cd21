"""Fault injection: faults acted out on request (over REST, off unless enabled), their
schedules and timers, and the records that link what they cause to them.

`heartbeat_loss` acts in the sensor: its fault marks mute the node. GPU errors go
through the node's real watchdogs when the backend runs processes (local mode), else
straight to the sensor. Worker and node faults need a backend that runs processes; the
sensor's fault marks then expect their consequences on the node, so that the events they
cause carry the fault's id. A schedule injects faults at random until ended, and
outlives a restart of the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.actuator import ActionError, Backend
from supervisor.config import Settings
from supervisor.domain import Event, Fault
from supervisor.errors import FaultNotSupported, UnknownTarget
from supervisor.sensor import Changes, GpuReport, Sensor
from supervisor.store import Store

log = logging.getLogger(__name__)

#: Faults the sensor can act out by itself, with any backend.
SENSOR_FAULTS = frozenset({"heartbeat_loss", "xid", "ecc"})
#: Faults that happen once (a kill, a signal, a GPU error): over as soon as acted out.
ONE_SHOT_FAULTS = frozenset({"node_down", "worker_crash", "worker_hang", "xid", "ecc"})

#: What a `random` schedule draws from (Google's rank_killed, rank_hung, plus nodes).
RANDOM_KINDS = ("worker_crash", "worker_hang", "node_down")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    node: str | None
    job: str | None
    params: dict[str, Any]
    schedule: tuple[str, float] | None = None


class FaultHost(Protocol):
    """What fault injection needs of the supervisor it runs in."""

    settings: Settings
    sensor: Sensor
    backend: Backend

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
        if spec.schedule is not None:
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
            if spec.kind == "straggler":  # seen once it stayed slow for a window or so
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
        if spec.kind == "heartbeat_loss":
            duration = spec.params.get("duration_s")
            self.sensor.fault_marks.mute(spec.node, fault.id, duration)
            if duration is not None:
                loop = asyncio.get_running_loop()
                self._fault_timers[fault.id] = loop.call_later(
                    duration, lambda: asyncio.ensure_future(self.end(fault.id))
                )
            return fault, []
        report = GpuReport(
            kind="xid" if spec.kind == "xid" else "ecc",
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
        """Inject faults at random (exponential gaps of the given mean) until ended."""
        assert spec.schedule is not None
        kind, mean_s = spec.schedule
        kinds = RANDOM_KINDS if kind == "random" else (kind,)
        unsupported = [k for k in kinds if k not in self.backend.process_faults | SENSOR_FAULTS]
        if unsupported:
            raise FaultNotSupported(f"schedule: {unsupported[0]} faults need the local backend")
        if spec.job is not None and not self.sensor.has_job(spec.job):
            raise UnknownTarget(f"job {spec.job!r} is not known")
        fault = await asyncio.to_thread(
            lambda: self.store.create_fault("schedule", node=None, job=spec.job, params=spec.params)
        )
        self._schedules[fault.id] = asyncio.create_task(
            self._run_schedule(fault.id, kinds, mean_s, spec.job), name=f"faults:{fault.id}"
        )
        return fault

    async def resume(self) -> None:
        """Fault schedules outlive a restart of the supervisor, like the faults they cause."""
        for fault in await asyncio.to_thread(self.store.list_faults, True):
            schedule = str(fault.params.get("schedule", ""))
            kind, _, mean = schedule.partition(",")
            if fault.kind != "schedule" or not mean:
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
            nodes, _ = self.sensor.snapshot()
            targets = sorted(
                n.name
                for n in nodes.values()
                if n.alive and n.job is not None and (job is None or n.job == job)
            )
            if not targets:
                continue
            kind = rng.choice(kinds)
            node = rng.choice(targets)
            params: dict[str, Any] = {"schedule": parent}
            if kind == "xid":
                params["code"] = rng.choice((43, 48, 63, 74, 79))
            elif kind == "ecc":
                params["count"] = 1
            try:
                await self.inject(FaultSpec(kind, node, nodes[node].job, params))
                log.info("schedule %s injected %s on %s", parent, kind, node)
            except (FaultNotSupported, UnknownTarget) as exc:
                log.warning("schedule %s could not inject %s on %s: %s", parent, kind, node, exc)

    async def end(self, fault_id: int) -> Fault | None:
        """End a fault (a schedule stops; a heartbeat loss is over); ended already: as is."""
        schedule = self._schedules.pop(fault_id, None)
        if schedule is not None:
            schedule.cancel()
        timer = self._fault_timers.pop(fault_id, None)
        if timer is not None:
            timer.cancel()
        self.sensor.fault_marks.end(fault_id)
        return await asyncio.to_thread(self.store.end_fault, fault_id)
