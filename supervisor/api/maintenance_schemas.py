"""Requests and answers of the maintenance windows' API."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from supervisor.api.schemas import Name, UtcTime
from supervisor.domain import utcnow
from supervisor.schedules.maintenance import Window, end_steps, start_steps


class MaintenanceIn(BaseModel):
    """A maintenance window on a node: at `start` the node's job is checkpointed and
    hot-swapped off it and the node cordoned; at `end` it is uncordoned (a spare)."""

    model_config = ConfigDict(extra="forbid")

    node: Name
    start: UtcTime = Field(description="When the window opens (now or later; a past time: now).")
    end: UtcTime = Field(description="When it closes: after `start`, in the future.")
    reason: str = Field("", max_length=500, pattern=r"^[^\x00]*$")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.end <= self.start:
            raise ValueError("end: must be after start")
        if self.end <= utcnow():
            raise ValueError("end: is in the past")
        return self

    def window(self, window_id: str | None = None) -> Window:
        if window_id is None:
            return Window.new(self.node, self.start, self.end, self.reason)
        return Window(window_id, self.node, self.start, self.end, self.reason)


class MaintenanceOut(BaseModel):
    id: str
    node: str
    job: str | None = Field(
        description="The node's job as it last reported: the one the start moves off."
    )
    start: datetime
    end: datetime
    reason: str
    state: Literal["scheduled", "open"] = Field(
        description="scheduled: `start` is to come; open: the node is out until `end`."
    )
    next_run: datetime | None = Field(description="When the next step (start or end) runs.")
    steps: list[str] = Field(
        description="The actions the next step requests, in order: at the start "
        "emergency_checkpoint, hot_swap, cordon (a node with no job: cordon); at the end "
        "uncordon."
    )

    @classmethod
    def of(cls, window: Window, next_run: datetime | None, job: str | None) -> MaintenanceOut:
        opened = next_run is None or next_run >= window.end
        steps = end_steps(window) if opened else start_steps(window, job)
        return cls(
            id=window.id,
            node=window.node,
            job=job,
            start=window.start,
            end=window.end,
            reason=window.reason,
            state="open" if opened else "scheduled",
            next_run=next_run,
            steps=[request.type.value for request, _ in steps],
        )

    @classmethod
    def of_job(
        cls, kwargs: dict[str, Any], next_run: datetime | None, job_of: Callable[[str], str | None]
    ) -> MaintenanceOut:
        window = Window.of(kwargs)
        return cls.of(window, next_run, job_of(window.node))
