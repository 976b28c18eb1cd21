"""The events the sensor raises about a node, each checked by its type's details model."""

from __future__ import annotations

from typing import Any

from supervisor.domain import Event, EventType, utcnow
from supervisor.event_details import EVENT_DETAILS
from supervisor.sensor.fault_marks import FaultMarks
from supervisor.sensor.nodes import NodeRecord


class NodeEvents:
    """Builds a node's events, carrying the fault its failure is due to (fault_marks.py)."""

    __slots__ = ("_fault_marks",)

    def __init__(self, fault_marks: FaultMarks) -> None:
        self._fault_marks = fault_marks

    def event(
        self,
        type_: EventType,
        node: NodeRecord,
        *,
        rank: int | None = None,
        fault_id: int | None = None,
        **details: Any,
    ) -> Event:
        if fault_id is None:
            fault_id = self._fault_marks.attributed(node.name)
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
