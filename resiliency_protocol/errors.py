"""The error body of our HTTP APIs (the supervisor's and the host monitor's); how their
clients read it back is in error_reading.py (without pydantic: a CLI call starts sooner).

Every error answer is an `ErrorOut`: `message`, one line that names the offending field
where there is one, and `detail` as FastAPI gives it. Each server answers with it from its
own FastAPI handlers (supervisor/api/errors.py, host_monitor/error_handlers.py), which build it
here. Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, Field


class ErrorOut(BaseModel):
    """Every error answer of the API (4xx and 5xx alike)."""

    message: str = Field(description="One line; names the offending field where there is one.")
    detail: Any = Field(
        description="As FastAPI gives it: a string, or for a 422 of validation the list of "
        "errors with `loc`, `msg` and `type`."
    )


def error_body(message: str, detail: Any) -> dict[str, Any]:
    """An `ErrorOut` as JSON."""
    return {"message": message, "detail": detail}


def validation_error_body(errors: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The `ErrorOut` of a 422 for pydantic's validation errors: `message` names each
    offending field in one line, `detail` keeps each error's `loc`, `msg` and `type`."""
    errors = list(errors)
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}".replace("Value error, ", ""))
    detail = [{k: v for k, v in err.items() if k in ("loc", "msg", "type")} for err in errors]
    return error_body("; ".join(parts), detail)
