"""The field types the bodies share: names, times and JSON numbers as the schema has them
(the numbers and times are the protocol package's, which the cross-process bodies use)."""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

from resiliency_protocol.json_types import JsonFloat as JsonFloat
from resiliency_protocol.json_types import JsonInt as JsonInt
from resiliency_protocol.json_types import UtcTime as UtcTime
from resiliency_protocol.json_types import date_time_text as date_time_text
from resiliency_protocol.json_types import in_utc as in_utc
from supervisor.domain import NAME_PATTERN

Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=NAME_PATTERN)]
