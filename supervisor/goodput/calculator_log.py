"""The gpu-recipes goodput calculator's JSON-lines event log, and its goodput formula.

The goodput calculator of Google's gpu-recipes (``resiliency_metrics``) logs one
JSON object per line, written by its tracker as
``{"timestamp": "<ISO 8601>", "job_name": "...", "event_type": "...", "step": N}``:
``timestamp`` is the writer's naive local time (``datetime.now().isoformat()``), ``step``
is present on ``checkpoint_loaded`` and ``checkpoint_saved``. Its calculator computes::

    goodput% = (max_saved_step - min_loaded_step) * reference_step_time
               / (last_ts - first_ts) * 100

and :func:`calculator_goodput` reproduces that figure, including its zero cases.

What this parser accepts (assumptions, all documented here):

- Field names: the calculator's (``event_type``, ``timestamp``, ``step``, ``job_name``) first,
  then common alternatives, first present wins: event ``event``/``type``/``eventType``/
  ``event_name``; time ``time``/``ts``/``@timestamp``/``datetime``/``event_time``/
  ``eventTime``/``timestamp_s``/``unix_time``; step ``checkpoint_step``/``global_step``/
  ``iteration``/``step_num``/``ckpt_step``; job ``job``/``jobName``/``job_id``.
- A Cloud Logging export entry (``{"jsonPayload": {...}, "timestamp": ...}``, which is
  where the calculator's tracker writes by default) is unwrapped; the payload's fields win.
- Event names are matched case-insensitively, with ``-`` and spaces read as ``_``.
  Unknown event names are kept as "other" events: like the calculator, they still count for
  the first and last timestamp. ``strict=True`` rejects them instead.
- Timestamps: ISO 8601 strings (``Z`` or an offset, or naive, which is read as UTC: only
  differences matter, but a naive log spanning a DST change is off by an hour, as the
  calculator is), or Unix time as a number or numeric string. Numbers too large to be seconds
  are read by magnitude as milliseconds (>= 1e11), microseconds (>= 1e14) or nanoseconds
  (>= 1e17).
- Steps: non-negative integers (integral floats and digit strings accepted). A
  checkpoint event without a step is an error (the calculator silently reads it as step 0).
- Blank lines are skipped; any other bad line raises :class:`CalculatorLogError` naming the
  line number and the field (the calculator skips unparsable lines with a warning).
- Events are ordered by parsed time, ties by the calculator's event order (the calculator sorts
  the timestamp strings, which is the same order for a log written in one format).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from supervisor.errors import SupervisorError


class CalculatorEventType(StrEnum):
    USER_SCHEDULED = "user_scheduled"
    JOB_STARTED = "job_started"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_SAVED = "checkpoint_saved"
    USER_TERMINATED = "user_terminated"
    JOB_TERMINATED = "job_terminated"


#: The calculator's tie-break order for events with equal timestamps.
EVENT_ORDER: dict[str, int] = {t.value: i for i, t in enumerate(CalculatorEventType)}

CHECKPOINT_EVENTS = frozenset(
    {CalculatorEventType.CHECKPOINT_LOADED, CalculatorEventType.CHECKPOINT_SAVED}
)

EVENT_KEYS = ("event_type", "event", "type", "eventType", "event_name")
TIME_KEYS = (
    "timestamp",
    "time",
    "ts",
    "@timestamp",
    "datetime",
    "event_time",
    "eventTime",
    "timestamp_s",
    "unix_time",
)
STEP_KEYS = ("step", "checkpoint_step", "global_step", "iteration", "step_num", "ckpt_step")
JOB_KEYS = ("job_name", "job", "jobName", "job_id")

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


class CalculatorLogError(SupervisorError, ValueError):
    """A bad line of a calculator log: ``line`` (1-based) and ``field`` say where."""

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None):
        self.line = line
        self.field = field
        self.reason = message
        where = []
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


@dataclass(frozen=True)
class CalculatorEvent:
    """One event of a calculator log. ``timestamp`` is in Unix seconds."""

    event_type: str
    timestamp: float
    step: int | None = None
    job_name: str | None = None
    #: 1-based line number in the log (0 when built in code).
    line: int = 0

    @property
    def kind(self) -> CalculatorEventType | None:
        """The event's type, or None for an event type the calculator does not know."""
        try:
            return CalculatorEventType(self.event_type)
        except ValueError:
            return None

    def sort_key(self) -> tuple[float, int, int]:
        return (self.timestamp, EVENT_ORDER.get(self.event_type, len(EVENT_ORDER)), self.line)


# --- parsing ------------------------------------------------------------------------------


def _epoch_seconds(value: float) -> float:
    magnitude = abs(value)
    if magnitude >= 1e17:
        return value / 1e9
    if magnitude >= 1e14:
        return value / 1e6
    if magnitude >= 1e11:
        return value / 1e3
    return value


def parse_timestamp(value: object) -> float:
    """Unix seconds from an ISO 8601 string, a ``datetime`` or a Unix time (see module doc).

    Raises ValueError with the reason when the value is none of those.
    """
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, bool) or value is None:
        raise ValueError(f"expected an ISO 8601 string or Unix seconds, got {value!r}")
    elif isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite Unix time, got {value!r}")
        return _epoch_seconds(float(value))
    elif isinstance(value, str):
        text = value.strip()
        if _NUMBER.match(text):
            return _epoch_seconds(float(text))
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(
                f"expected an ISO 8601 string or Unix seconds, got {value!r}"
            ) from None
    else:
        raise ValueError(f"expected an ISO 8601 string or Unix seconds, got {type(value).__name__}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _parse_step(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _first(obj: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
    for key in keys:
        if key in obj and obj[key] is not None:
            return key, obj[key]
    return None


def normalize_event_type(name: str) -> str:
    return re.sub(r"[-\s]+", "_", name.strip()).lower()


def parse_calculator_event(obj: object, *, line: int = 0, strict: bool = False) -> CalculatorEvent:
    """One event from a decoded JSON value (``line`` is only used in error messages)."""
    if not isinstance(obj, dict):
        raise CalculatorLogError(
            f"expected a JSON object, got {type(obj).__name__}", line=line or None
        )
    fields: dict[str, Any] = obj
    envelope: dict[str, Any] = {}
    payload = obj.get("jsonPayload")
    if isinstance(payload, dict):
        envelope, fields = obj, payload
    where = line or None

    found = _first(fields, EVENT_KEYS)
    if found is None:
        raise CalculatorLogError("missing (no event type)", line=where, field="event_type")
    key, raw_type = found
    if not isinstance(raw_type, str) or not raw_type.strip():
        raise CalculatorLogError(f"expected an event name, got {raw_type!r}", line=where, field=key)
    event_type = normalize_event_type(raw_type)
    if strict and event_type not in EVENT_ORDER:
        raise CalculatorLogError(
            f"unknown event type {raw_type!r} (expected one of {', '.join(EVENT_ORDER)})",
            line=where,
            field=key,
        )

    found = _first(fields, TIME_KEYS) or _first(envelope, TIME_KEYS)
    if found is None:
        raise CalculatorLogError("missing (no timestamp)", line=where, field="timestamp")
    key, raw_time = found
    try:
        timestamp = parse_timestamp(raw_time)
    except ValueError as exc:
        raise CalculatorLogError(str(exc), line=where, field=key) from None

    step: int | None = None
    found = _first(fields, STEP_KEYS)
    if found is not None:
        key, raw_step = found
        try:
            step = _parse_step(raw_step)
        except ValueError as exc:
            raise CalculatorLogError(str(exc), line=where, field=key) from None
    elif event_type in CHECKPOINT_EVENTS:
        raise CalculatorLogError(
            f"missing (a {event_type} event needs a step)", line=where, field="step"
        )

    job_name: str | None = None
    found = _first(fields, JOB_KEYS)
    if found is not None:
        job_name = str(found[1])
    return CalculatorEvent(event_type, timestamp, step, job_name, line)


def parse_calculator_log(lines: Iterable[str], *, strict: bool = False) -> list[CalculatorEvent]:
    """Parse JSON lines into events, sorted by time (ties in the calculator's event order).

    Raises :class:`CalculatorLogError` on the first bad line.
    """
    events: list[CalculatorEvent] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalculatorLogError(
                f"invalid JSON: {exc.msg} at column {exc.colno}", line=number
            ) from None
        events.append(parse_calculator_event(obj, line=number, strict=strict))
    events.sort(key=CalculatorEvent.sort_key)
    return events


def read_calculator_log(path: str | Path, *, strict: bool = False) -> list[CalculatorEvent]:
    """Read and parse a calculator log file (UTF-8). Errors name the file and the line."""
    with open(path, encoding="utf-8") as f:
        try:
            return parse_calculator_log(f, strict=strict)
        except CalculatorLogError as exc:
            raise CalculatorLogError(f"{path}: {exc}") from exc


# --- the calculator's formula -----------------------------------------------------------------


def select_job(
    events: Sequence[CalculatorEvent], job_name: str | None = None
) -> list[CalculatorEvent]:
    """The events of one job, sorted, as the calculator selects them.

    With ``job_name``, the events carrying that name. Without, the job of the earliest
    event when it has one (the calculator's default), else every event.
    """
    ordered = sorted(events, key=CalculatorEvent.sort_key)
    if job_name is None and ordered:
        job_name = ordered[0].job_name
    if job_name is None:
        return ordered
    return [e for e in ordered if e.job_name == job_name]


def collapse_repeats(events: Sequence[CalculatorEvent]) -> list[CalculatorEvent]:
    """Keep only the last of consecutive ``job_started`` (or ``job_terminated``) events.

    The calculator does this (several ranks may log the same start); it changes neither the
    first nor the last timestamp.
    """
    out: list[CalculatorEvent] = []
    repeatable = (CalculatorEventType.JOB_STARTED, CalculatorEventType.JOB_TERMINATED)
    for event in events:
        if out and event.event_type in repeatable and out[-1].event_type == event.event_type:
            out.pop()
        out.append(event)
    return out


@dataclass(frozen=True)
class CalculatorGoodput:
    """The calculator's figures for one job's log."""

    goodput_percent: float
    #: last_ts - first_ts over all the job's events.
    total_runtime_s: float
    #: (max_saved_step - min_loaded_step) * reference_step_time, or 0.
    effective_time_s: float
    reference_step_time_s: float | None
    min_loaded_step: int | None
    max_saved_step: int | None
    job_name: str | None
    events: int
    job_starts: int
    #: Loads of a step above 0 (the calculator's count).
    checkpoints_loaded: int
    checkpoints_saved: int
    #: Events of a type the calculator does not know (they count only for the time span).
    other_events: int
    #: Why the figure is zero, when it is.
    zero_reason: str | None = None

    @property
    def step_diff(self) -> int:
        if self.min_loaded_step is None or self.max_saved_step is None:
            return 0
        return self.max_saved_step - self.min_loaded_step


def calculator_goodput(
    events: Sequence[CalculatorEvent],
    reference_step_time_s: float | None,
    *,
    job_name: str | None = None,
) -> CalculatorGoodput:
    """The calculator's goodput on ``events``, exactly as its formula gives it.

    ``goodput% = (max_saved_step - min_loaded_step) * reference_step_time_s
    / (last_ts - first_ts) * 100``, over the events of one job (:func:`select_job`).
    Like the calculator it is 0 when there is no reference step time (None or 0), no
    ``checkpoint_loaded`` event, no saved step above 0, a step difference <= 0, or a zero
    time span; ``zero_reason`` says which.
    """
    if reference_step_time_s is not None and (
        not math.isfinite(reference_step_time_s) or reference_step_time_s < 0
    ):
        raise ValueError(
            f"reference_step_time_s must be a non-negative number, got {reference_step_time_s!r}"
        )
    selected = collapse_repeats(select_job(events, job_name))
    job = job_name if job_name is not None else (selected[0].job_name if selected else None)
    runtime = selected[-1].timestamp - selected[0].timestamp if selected else 0.0

    loaded = [
        e.step or 0 for e in selected if e.event_type == CalculatorEventType.CHECKPOINT_LOADED
    ]
    saved = [e.step or 0 for e in selected if e.event_type == CalculatorEventType.CHECKPOINT_SAVED]
    min_loaded = min(loaded) if loaded else None
    max_saved = max([0, *saved]) if saved else None

    reason: str | None = None
    effective = 0.0
    percent = 0.0
    if not selected:
        reason = "no events" if job is None else f"no events for job {job!r}"
    elif min_loaded is None:
        reason = "no checkpoint_loaded event"
    elif max_saved is None or max_saved <= 0:
        reason = "no checkpoint saved at a step above 0"
    elif max_saved - min_loaded <= 0:
        reason = "no step saved beyond the first step loaded"
    elif not reference_step_time_s:
        reason = "no reference step time"
    else:
        effective = (max_saved - min_loaded) * reference_step_time_s
        if runtime > 0:
            percent = effective / runtime * 100
        else:
            reason = "the events span no time"
    return CalculatorGoodput(
        goodput_percent=percent,
        total_runtime_s=runtime,
        effective_time_s=effective,
        reference_step_time_s=reference_step_time_s,
        min_loaded_step=min_loaded,
        max_saved_step=max_saved,
        job_name=job,
        events=len(selected),
        job_starts=sum(1 for e in selected if e.event_type == CalculatorEventType.JOB_STARTED),
        checkpoints_loaded=sum(1 for step in loaded if step > 0),
        checkpoints_saved=len(saved),
        other_events=sum(1 for e in selected if e.kind is None),
        zero_reason=reason,
    )
