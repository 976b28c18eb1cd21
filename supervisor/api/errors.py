"""The error format of our HTTP APIs (the supervisor's and the host monitor's), and how
their clients read it back."""

from __future__ import annotations

import httpx
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """An error raised in route code, in the same shape as a validation error: `message`
    (one line, naming the field where there is one), and `detail` as FastAPI gives it."""
    assert isinstance(exc, StarletteHTTPException)
    body = {"message": str(exc.detail), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 for a request that needed the database while it cannot be reached or written:
    nothing was recorded (its transaction did not commit); the client may try again."""
    message = "database unavailable: nothing was recorded; try again"
    return JSONResponse(
        {"message": message, "detail": message}, status_code=503, headers={"Retry-After": "1"}
    )


def error_message(response: httpx.Response) -> str:
    """The one line an error answer of ours carries (`message`, else `detail`)."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(data, dict):
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])[:500]
    return str(data)[:200]
