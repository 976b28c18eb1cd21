"""The host monitor's FastAPI handlers for errors, answering with the supervisor's error
body (resiliency_protocol.errors), so one client reads both APIs' errors alike."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from resiliency_protocol.errors import error_body, validation_error_body


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 whose `message` names each offending field in one line."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(validation_error_body(exc.errors()), status_code=422)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """An error raised in route code: `message` (one line) and `detail` as FastAPI gives it."""
    assert isinstance(exc, StarletteHTTPException)
    body = error_body(str(exc.detail), exc.detail)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
