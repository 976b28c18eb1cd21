"""The HTTP server `supervisor serve` runs the app in: uvicorn's, ending the live streams
when it stops."""

from __future__ import annotations

from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from supervisor.live_hub import Hub


class StreamEndingServer(uvicorn.Server):
    """Ends the live streams (dashboards) when asked to stop: uvicorn waits for open
    responses before it stops the app, and a stream never ends by itself."""

    def __init__(self, config: uvicorn.Config, hub: Hub) -> None:
        super().__init__(config)
        self.hub = hub

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.hub.close_threadsafe()
        super().handle_exit(sig, frame)
