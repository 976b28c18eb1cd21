"""Numbers and times as the JSON Schema of our bodies has them, for pydantic bodies that
cross a process boundary (pydantic's lax mode would take `false`, `"3"` or a number of
seconds where the schema says integer, number or `date-time`). Imports nothing from
supervisor, host_monitor or training.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Strict


def in_utc(value: datetime | None) -> datetime | None:
    """A time in UTC (a time without a zone is taken as UTC). A zone that moves it out of
    the years 1-9999 (0001-01-01T00:00:00+14:00) is refused here, not a 500 later."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range once in UTC (years 1 to 9999)") from None


#: The date and time of RFC 3339 (what the schema's `date-time` means), zone aside.
_DATE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}").match


def date_time_text(value: Any) -> Any:
    """Refuse a time given as anything but a date and time: pydantic would take "3" or
    3 as seconds since 1970, which the documented `date-time` does not allow."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or _DATE_TIME(value) is None:
        raise ValueError("expected a date and time (RFC 3339, e.g. 2024-05-01T12:00:00Z)")
    return value


def _whole_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: Numbers as the schema has them (pydantic's lax mode took `false` and `"3"` too): an
#: integer is 3 or 3.0, a number 3 or 3.5.
JsonInt = Annotated[int, BeforeValidator(_whole_number), Strict()]
JsonFloat = Annotated[float, Strict()]

#: A time as stored and compared: in UTC, and representable there.
UtcTime = Annotated[datetime, BeforeValidator(date_time_text), AfterValidator(in_utc)]
