"""Event loops: uvloop when available, as the service runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from importlib.metadata import version
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop

    LOOP_NAME = f"uvloop {version('uvloop')}"
    _factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
    LOOP_NAME = "asyncio"
    _factory = None


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on a fresh loop (uvloop if installed)."""
    with asyncio.Runner(loop_factory=_factory) as runner:
        return runner.run(main)
