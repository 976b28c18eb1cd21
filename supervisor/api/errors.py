"""The error format of our HTTP APIs (the supervisor's and the host monitor's)."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 whose `message` names each offending field in one line."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}".replace("Value error, ", ""))
    detail = [{k: v for k, v in err.items() if k in ("loc", "msg", "type")} for err in errors]
    return JSONResponse({"message": "; ".join(parts), "detail": detail}, status_code=422)
