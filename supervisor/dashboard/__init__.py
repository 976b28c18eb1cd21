"""The dashboard: its page and static files, served by the supervisor at `/` (and the
page of simulated runs at `/simulate`).

Plain HTML, CSS and JavaScript modules shipped in the package: no build step, no CDN,
so it works offline. The page reads the same REST API and live stream as any client,
with the operator token it asks for (kept in the tab's sessionStorage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

STATIC = Path(__file__).parent / "static"

#: Only our own files run, and nothing leaves for another origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return _page("index.html")


@router.get("/simulate")
async def simulate() -> FileResponse:
    """Renders the JSON of `supervisor simulate -o json`, read in the browser."""
    return _page("simulate.html")


def _page(name: str) -> FileResponse:
    return FileResponse(
        STATIC / name,
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


class _Revalidated(StaticFiles):
    """Static files the browser must revalidate (cheap: ETag), so an upgraded supervisor
    never runs with yesterday's scripts."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", _Revalidated(directory=STATIC), name="dashboard")
