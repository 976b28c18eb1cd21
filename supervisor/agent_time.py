"""The one rule every time an agent sends goes through (a heartbeat's GPU reports, a
checkpoint report): it names its zone, it lies within the years 1-9999 once in UTC, and
it lies within `agent_clock_skew_s` of the supervisor's own clock. An agent whose clock
is off by months would otherwise move a job's start, and its goodput, by months.

Outside the rule the request is refused with a 422 naming the field (`AgentTimeError`
carries its location); nothing of it is recorded.
"""

from __future__ import annotations

from datetime import UTC, datetime

from supervisor.domain import utcnow
from supervisor.errors import SupervisorError


class AgentTimeError(SupervisorError, ValueError):
    """A time an agent sent is outside the rule; `loc` is the field's path in the body."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def agent_time(
    value: datetime,
    loc: tuple[str | int, ...],
    *,
    max_skew_s: float,
    now: datetime | None = None,
    max_age_s: float | None = None,
) -> datetime:
    """`value` in UTC, when it follows the rule; else AgentTimeError naming `loc`.

    `max_age_s`: how far before `now` it may lie (default `max_skew_s`): a report kept
    by its agent for a while, set against the agent's own time of sending."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise AgentTimeError(loc, "a time needs its zone (e.g. 2024-05-01T12:00:00Z)")
    try:
        in_utc = value.astimezone(UTC)
    except OverflowError:
        raise AgentTimeError(loc, "out of range once in UTC (years 1 to 9999)") from None
    now = utcnow() if now is None else now
    off = (in_utc - now).total_seconds()
    if off > max_skew_s or -off > (max_skew_s if max_age_s is None else max_age_s):
        side = "ahead of" if off > 0 else "behind"
        raise AgentTimeError(
            loc,
            f"{abs(off):.0f} s {side} the supervisor's clock (more than "
            f"agent_clock_skew_s, {max_skew_s:g} s): check the agent's clock"
            if max_age_s is None
            else f"{abs(off):.0f} s {side} the batch's sent_at (at most "
            f"{max_skew_s:g} s after it, {max_age_s:g} s before it)",
        )
    return in_utc
