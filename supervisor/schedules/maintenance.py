"""Maintenance windows: at `start`, the node's job is checkpointed (an emergency
checkpoint), hot-swapped off the node, and the node cordoned; at `end` it is uncordoned
and back as a spare.

Each step is an action requested through the supervisor's normal path (recorded before
and after it runs, on the job's lane, in that order, with the actuator's timeouts), with
a key made of the window and the step: a step run twice (the supervisor was killed in
the middle) is recorded once.

A window is one stored job, `maintenance:<id>`, firing at `start` and at `end`; its
arguments are the window itself. A run decides its step by the time: before `end` it
starts the window, from `end` on it ends it. Both steps must happen however late they
are, so these jobs have no grace time: a supervisor down across `start` starts the
window when it is back; one down across the whole window only ends it (coalesced).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from apscheduler.triggers.base import BaseTrigger

from supervisor.domain import ActionRecord, ActionRequest, ActionType, utcnow

log = logging.getLogger(__name__)

#: The stored job's function (a reference: APScheduler keeps it as text).
RUN_WINDOW = "supervisor.schedules.jobs:run_window"
PREFIX = "maintenance:"


class WindowTrigger(BaseTrigger):
    """Fires at `start`, then at `end`, then never again."""

    def __init__(self, start: datetime, end: datetime) -> None:
        self.start = start
        self.end = end

    def get_next_fire_time(
        self, previous_fire_time: datetime | None, now: datetime
    ) -> datetime | None:
        if previous_fire_time is None:
            return self.start
        if previous_fire_time < self.end:
            return self.end
        return None

    def __str__(self) -> str:
        return f"window[{self.start.isoformat()}, {self.end.isoformat()}]"


@dataclass(frozen=True, slots=True)
class Window:
    id: str
    node: str
    start: datetime
    end: datetime
    reason: str = ""

    @classmethod
    def new(cls, node: str, start: datetime, end: datetime, reason: str = "") -> Window:
        return cls(uuid.uuid4().hex[:12], node, start, end, reason)

    @property
    def job_id(self) -> str:
        return PREFIX + self.id

    def kwargs(self) -> dict[str, Any]:
        return {
            "window": {
                "id": self.id,
                "node": self.node,
                "start": self.start.isoformat(),
                "end": self.end.isoformat(),
                "reason": self.reason,
            }
        }

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Window:
        w = kwargs["window"]
        return cls(
            w["id"],
            w["node"],
            datetime.fromisoformat(w["start"]),
            datetime.fromisoformat(w["end"]),
            w.get("reason", ""),
        )

    def trigger(self) -> WindowTrigger:
        return WindowTrigger(self.start, self.end)

    def why(self) -> str:
        said = f": {self.reason}" if self.reason else ""
        return (
            f"maintenance window {self.id} on {self.node} "
            f"({self.start.isoformat()} to {self.end.isoformat()}){said}"
        )


class WindowHost(Protocol):
    """What a window needs of the supervisor it runs in."""

    def node_job(self, node: str) -> str | None: ...

    async def request_actions(
        self, requests: list[tuple[ActionRequest, str]], source: str
    ) -> list[ActionRecord]: ...


def start_steps(window: Window, job: str | None) -> list[tuple[ActionRequest, str]]:
    """Checkpoint the job, swap it off the node, cordon the node (the job's lane runs
    them in this order); a node that runs no job is only cordoned."""
    why = window.why()
    key = f"maintenance-{window.id}-"
    steps = []
    if job is not None:
        steps += [
            (
                ActionRequest(ActionType.EMERGENCY_CHECKPOINT, job=job, reason=why),
                key + "checkpoint",
            ),
            (
                ActionRequest(ActionType.HOT_SWAP, job=job, node=window.node, reason=why),
                key + "swap",
            ),
        ]
    steps.append(
        (ActionRequest(ActionType.CORDON, job=job, node=window.node, reason=why), key + "cordon")
    )
    return steps


def end_steps(window: Window) -> list[tuple[ActionRequest, str]]:
    request = ActionRequest(ActionType.UNCORDON, node=window.node, reason=window.why())
    return [(request, f"maintenance-{window.id}-uncordon")]


async def run_step(host: WindowHost, window: Window, now: datetime | None = None) -> str:
    """Start or end the window, by the time; which one it did."""
    now = now or utcnow()
    if now < window.end:
        steps = start_steps(window, host.node_job(window.node))
        phase = "start"
    else:
        steps = end_steps(window)
        phase = "end"
    actions = await host.request_actions(steps, source="maintenance")
    log.info(
        "maintenance window %s %s on %s: actions %s",
        window.id,
        phase,
        window.node,
        [a.id for a in actions],
    )
    return phase
