"""The supervisor's FastAPI handlers for errors: each answers with the error body of
resiliency_protocol.errors (`ErrorOut`), which the host monitor's handlers share."""

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
    """An error raised in route code, in the same shape as a validation error: `message`
    (one line, naming the field where there is one), and `detail` as FastAPI gives it."""
    assert isinstance(exc, StarletteHTTPException)
    body = error_body(str(exc.detail), exc.detail)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 for a request that needed the database while it cannot be reached or written:
    nothing was recorded (its transaction did not commit); the client may try again."""
    message = "database unavailable: nothing was recorded; try again"
    return JSONResponse(error_body(message, message), status_code=503, headers={"Retry-After": "1"})
