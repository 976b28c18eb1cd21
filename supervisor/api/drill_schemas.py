"""A fault drill as the faults' API takes it (`FaultIn.schedule`), and the errors a bad
one gets: named by the drill's own field (`schedule: cron: ...`), not by the
alternatives of the union pydantic tried."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from resiliency_protocol.faults import DRILL_KINDS
from supervisor.domain import NAME_PATTERN
from supervisor.schedules.drills import Drill, cron_trigger

Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=NAME_PATTERN)]

#: A random schedule's text: `random` or a kind a drill may inject, and the mean interval.
SCHEDULE_PATTERN = (
    rf"^(random|{'|'.join(DRILL_KINDS)}),"
    r"([0-9]+(\.[0-9]+)?)$"
)

if TYPE_CHECKING:
    DrillKind: TypeAlias = str
else:
    # Literal[...] of the table's drill kinds' values: a wrong kind's 422 and the JSON
    # schema list them plainly, as a written-out Literal's do.
    DrillKind = Literal[tuple(k.value for k in DRILL_KINDS)]


class DrillIn(BaseModel):
    """A fault drill: one fault of `kinds` per run, on a live node of `job` (or any job),
    at the times of `cron` (5 fields, UTC) or every `every_s` seconds, until deleted."""

    model_config = ConfigDict(extra="forbid")

    cron: str | None = Field(
        None, examples=["0 2 * * *"], description="minute hour day month weekday, in UTC."
    )
    every_s: Annotated[float, Field(ge=1, le=31 * 86400)] | None = None
    kinds: list[DrillKind] = Field(min_length=1, max_length=16)
    job: Name | None = None

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.cron is None) == (self.every_s is None):
            raise ValueError("give exactly one of cron and every_s")
        if self.cron is not None:
            try:
                trigger = cron_trigger(self.cron)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"cron: {exc}") from None
            if trigger.get_next_fire_time(None, datetime.now(UTC)) is None:
                raise ValueError(f"cron: {self.cron!r} never fires")
        return self

    def drill(self) -> Drill:
        return Drill(tuple(dict.fromkeys(self.kinds)), cron=self.cron, every_s=self.every_s)


def check_schedule(value: Any) -> Any:
    """A random schedule's text or a drill, with errors named by the drill's own field
    (`schedule: cron: ...`), not by the alternatives pydantic tried."""
    if value is None or isinstance(value, DrillIn):
        return value
    if isinstance(value, str):
        if re.match(SCHEDULE_PATTERN, value) is None:
            raise ValueError(
                f"expected '<kind>,<mean_interval_s>' such as 'random,120', got {value!r}"
            )
        return value
    if not isinstance(value, dict):
        raise ValueError("expected a string such as 'random,120' or an object with cron or every_s")
    try:
        return DrillIn.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{where}: {msg}" if where else msg) from None
