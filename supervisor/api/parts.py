"""The parts of the running supervisor a route takes, each as the narrow role it uses.

A route names what it reads (`events: EventLog`) rather than reaching through the whole
supervisor (`supervisor.store.list_events`): its signature says which part of the service
it touches, and a test can hand it that part alone. Each is a FastAPI dependency, resolved
once per request.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import Depends

from supervisor.api.deps import SupervisorDep
from supervisor.sensor import Sensor
from supervisor.store import Store
from supervisor.store.actions import ActionRecords
from supervisor.store.deliveries import DeliveryRecords
from supervisor.store.events import EventRecords
from supervisor.store.fault_records import FaultRecords
from supervisor.store.goodput_history import GoodputHistory


class KnownNames(Protocol):
    """Whether the supervisor has seen a node or a job (a 404 for a typo)."""

    def has_node(self, name: str) -> bool: ...

    def has_job(self, name: str) -> bool: ...


async def _store(supervisor: SupervisorDep) -> Store:
    return supervisor.store


async def _sensor(supervisor: SupervisorDep) -> Sensor:
    return supervisor.sensor


EventLog = Annotated[EventRecords, Depends(_store)]
ActionLog = Annotated[ActionRecords, Depends(_store)]
FaultLog = Annotated[FaultRecords, Depends(_store)]
ProgressLog = Annotated[GoodputHistory, Depends(_store)]  # steps, checkpoints
DeliveryLog = Annotated[DeliveryRecords, Depends(_store)]
Known = Annotated[KnownNames, Depends(_sensor)]
