"""Log lines for people (`text`) or for a log pipeline (`json`), the same in every process.

`json` writes one object per line: `time` (RFC 3339, UTC), `level`, `logger`, `message`,
then the context a pipeline indexes on: `role` (supervisor, host-monitor, worker) and whichever
of `event`, `event_type`, `action`, `action_type`, `job`, `node`, `rank`, `step`, `fault_id`
the process knows (fixed for the process, such as a host monitor's node, or given by the
call: `log.warning("...", extra={"node": node, "action": action_id})`), and `exc` with the
traceback when there is one. A text line shows the same context after the message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from resiliency_protocol import worker_env

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
#: The context fields, in the order they are written.
CONTEXT_FIELDS = (
    *("role", "event", "event_type", "action", "action_type"),
    *("job", "node", "rank", "step", "fault_id"),
)
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
#: The format a host monitor gives the workers it launches (its own).
ENV_LOG_FORMAT = "RESILIENCY_LOG_FORMAT"


def _context(record: logging.LogRecord) -> dict[str, object]:
    return {
        name: value
        for name in CONTEXT_FIELDS
        if (value := getattr(record, name, None)) is not None and value != ""
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The usual line, its context (other than the role) after the message."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        context = {k: v for k, v in _context(record).items() if k != "role"}
        if context:
            text += " [" + " ".join(f"{k}={v}" for k, v in context.items()) + "]"
        return text


class _Fixed(logging.Filter):
    """Adds the process's fixed context to each record that does not carry its own."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self.fields.items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def configure_logging(
    level: str,
    fmt: LogFormat = "text",
    *,
    fixed: Mapping[str, object] | None = None,
    quiet: Mapping[str, int] | None = None,
    text_format: str = TEXT_FORMAT,
) -> None:
    """The root logger to stderr, in `fmt`, at `level`; `fixed`: context every line of
    this process carries (`role`, a host monitor's `node`, a worker's `job` and `rank`);
    `quiet`: levels for chatty loggers (httpx logs every request at info)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(text_format))
    handler.addFilter(_Fixed({k: v for k, v in (fixed or {}).items() if v not in (None, "")}))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name, quiet_level in (quiet or {}).items():
        logging.getLogger(name).setLevel(quiet_level)


def configure_worker_logging(
    level: str = "warning",
    env: Mapping[str, str] | None = None,
    *,
    text_format: str = TEXT_FORMAT,
) -> None:
    """A training process's logging, in the format its host monitor gave it
    (`RESILIENCY_LOG_FORMAT`, text when unset), with its job, node and rank as context."""
    env = os.environ if env is None else env
    fmt = env.get(ENV_LOG_FORMAT) or "text"
    if fmt not in LOG_FORMATS:
        raise ValueError(f"{ENV_LOG_FORMAT} must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    fixed = {
        "role": "worker",
        "job": env.get(worker_env.HOST_MONITOR_JOB),
        "node": env.get("NODE_NAME"),
        "rank": int(env["RANK"]) if env.get("RANK", "").isdigit() else None,
    }
    configure_logging(level, fmt, fixed=fixed, text_format=text_format)
