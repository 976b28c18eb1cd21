"""The parts of the running supervisor a route takes, each as the narrow role it uses.

A route names what it reads (`events: EventLog`) rather than reaching through the whole
supervisor (`supervisor.store.list_events`): its signature says which part of the service
it touches, and a test can hand it that part alone. Each is a FastAPI dependency, resolved
once per request. This module is the one place that takes parts off the runtime.

The store and the controller exist once the runtime has started: routes under /api/ only
run then (SupervisorApp refuses them before); /readyz, which answers before, takes the
database's `ping` as a function, called once it knows the runtime is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Protocol

from fastapi import Depends, Request
from prometheus_client import Counter

from resiliency_protocol.heartbeat import HostHeartbeat
from supervisor.actuator import Backend
from supervisor.config import Settings
from supervisor.controller import Controller
from supervisor.controller.budget import Budgets
from supervisor.live_hub import Hub
from supervisor.metrics import Metrics
from supervisor.remedies import RemediesInFlight
from supervisor.runtime import Supervisor
from supervisor.schedules import Scheduler
from supervisor.sensor import Sensor
from supervisor.sensor.sensor import Changes
from supervisor.sensor.worlds import WorldFence
from supervisor.store import Store
from supervisor.store.actions import ActionRecords
from supervisor.store.deliveries import DeliveryRecords
from supervisor.store.events import EventRecords
from supervisor.store.fault_records import FaultRecords
from supervisor.store.goodput_history import GoodputHistory
from supervisor.store.roles import HistorySource


@dataclass(frozen=True, slots=True)
class HeartbeatParts:
    """What the bare heartbeat routes use of the service, bound once when the app is built
    (a heartbeat is the hottest path: no dependency resolved per request)."""

    #: The sensor takes a heartbeat in (validating what it has not seen of the node).
    ingest: Callable[[HostHeartbeat, bytes | None], Changes]
    #: A node's silence counts from when its heartbeat was answered.
    answered: Callable[[str], None]
    #: A heartbeat as it may be applied: worker reports of an older world left out.
    fence: Callable[[HostHeartbeat], HostHeartbeat]
    #: A job's newest world, named in the answer.
    newest_world: Callable[[str], int | None]
    max_clock_skew_s: float
    refused: dict[str, int]
    rejected: Counter

    @classmethod
    def of(cls, supervisor: Supervisor) -> HeartbeatParts:
        return cls(
            ingest=supervisor.sensor.ingest,
            answered=supervisor.sensor.answered,
            fence=supervisor.worlds.heartbeat,
            newest_world=supervisor.worlds.newest,
            max_clock_skew_s=supervisor.settings.agent_clock_skew_s,
            refused=supervisor.metrics.agent_requests_refused,
            rejected=supervisor.metrics.heartbeats_rejected,
        )


class KnownNames(Protocol):
    """Whether the supervisor has seen a node or a job (a 404 for a typo)."""

    def has_node(self, name: str) -> bool: ...

    def has_job(self, name: str) -> bool: ...


# Dependencies are `async def`: FastAPI runs plain `def` ones in a thread pool, which
# costs more than the parts they hand out.
async def get_supervisor(request: Request) -> Supervisor:
    supervisor: Supervisor = request.app.state.supervisor
    return supervisor


#: The runtime itself, for what it does as a whole (record, request an action, inject a
#: fault; whether it is ready): never to reach a part through it.
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]


async def _store(supervisor: SupervisorDep) -> Store:
    return supervisor.store


async def _database_ping(supervisor: SupervisorDep) -> Callable[[], None]:
    def ping() -> None:
        supervisor.store.ping()  # looked up when called: the store exists once started

    return ping


async def _sensor(supervisor: SupervisorDep) -> Sensor:
    return supervisor.sensor


async def _settings(supervisor: SupervisorDep) -> Settings:
    return supervisor.settings


async def _metrics(supervisor: SupervisorDep) -> Metrics:
    return supervisor.metrics


async def _refusals(metrics: Annotated[Metrics, Depends(_metrics)]) -> dict[str, int]:
    return metrics.agent_requests_refused


async def _hub(supervisor: SupervisorDep) -> Hub:
    return supervisor.hub


async def _backend(supervisor: SupervisorDep) -> Backend:
    return supervisor.backend


async def _worlds(supervisor: SupervisorDep) -> WorldFence:
    return supervisor.worlds


async def _remedies(supervisor: SupervisorDep) -> RemediesInFlight:
    return supervisor.remedies


async def _controller(supervisor: SupervisorDep) -> Controller:
    return supervisor.controller


async def _budgets(controller: Annotated[Controller, Depends(_controller)]) -> Budgets:
    return controller.budgets


async def _scheduler(supervisor: SupervisorDep) -> Scheduler | None:
    return supervisor.scheduler


EventLog = Annotated[EventRecords, Depends(_store)]
ActionLog = Annotated[ActionRecords, Depends(_store)]
FaultLog = Annotated[FaultRecords, Depends(_store)]
ProgressLog = Annotated[GoodputHistory, Depends(_store)]  # steps, checkpoints
DeliveryLog = Annotated[DeliveryRecords, Depends(_store)]
History = Annotated[HistorySource, Depends(_store)]  # what the goodput service reads
DatabasePing = Annotated[Callable[[], None], Depends(_database_ping)]
Known = Annotated[KnownNames, Depends(_sensor)]
Picture = Annotated[Sensor, Depends(_sensor)]  # the live picture: nodes, jobs
SettingsDep = Annotated[Settings, Depends(_settings)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
#: Host monitors' requests refused, by reason (supervisor_agent_requests_refused_total).
Refusals = Annotated[dict[str, int], Depends(_refusals)]
LiveHub = Annotated[Hub, Depends(_hub)]
BackendDep = Annotated[Backend, Depends(_backend)]
Worlds = Annotated[WorldFence, Depends(_worlds)]
Remedies = Annotated[RemediesInFlight, Depends(_remedies)]
ControllerDep = Annotated[Controller, Depends(_controller)]
BudgetsDep = Annotated[Budgets, Depends(_budgets)]
#: The scheduler of maintenance windows; None while this replica is not acting (the
#: route answers 503 once the request is otherwise valid).
SchedulerDep = Annotated[Scheduler | None, Depends(_scheduler)]
