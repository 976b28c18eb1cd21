"""Request and response bodies of the REST API (what /openapi.json documents), one module
per resource:

    fields.py    the field types they share: names, UTC times, JSON numbers
    pages.py     a page of a list, with the cursor of the next
    events.py    events, and the heartbeat's answer
    actions.py   actions, and the one an operator asks for
    nodes.py     nodes and their workers
    jobs.py      jobs
    faults.py    faults to inject (or their schedule), and as recorded

The fault drills' and maintenance windows' bodies are beside this package
(drill_schemas.py, maintenance_schemas.py).
"""

from supervisor.api.schemas.actions import MAX_PARAMS_BYTES, ActionIn, ActionOut
from supervisor.api.schemas.events import EventOut, HeartbeatAck
from supervisor.api.schemas.faults import FaultIn, FaultKind, FaultOut
from supervisor.api.schemas.fields import (
    JsonFloat,
    JsonInt,
    Name,
    UtcTime,
    date_time_text,
    in_utc,
)
from supervisor.api.schemas.jobs import JobOut
from supervisor.api.schemas.nodes import NodeOut, WorkerOut
from supervisor.api.schemas.pages import Page

__all__ = [
    "MAX_PARAMS_BYTES",
    "ActionIn",
    "ActionOut",
    "EventOut",
    "FaultIn",
    "FaultKind",
    "FaultOut",
    "HeartbeatAck",
    "JobOut",
    "JsonFloat",
    "JsonInt",
    "Name",
    "NodeOut",
    "Page",
    "UtcTime",
    "WorkerOut",
    "date_time_text",
    "in_utc",
]
