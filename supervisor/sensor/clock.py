"""The sensor's clocks: the event loop's, which its deadlines run on, and Unix time."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.domain import wall_time
from supervisor.sensor.deadlines import DeadlineQueue
from supervisor.sensor.nodes import DeadlineKey

WALL_OFFSET_TOLERANCE_S = 0.001
#: The sensor's deadlines fire this late at most (and at most 1% of the heartbeat
#: timeout): what lets nearby deadlines share one wake-up of the event loop.
DEADLINE_RESOLUTION_S = 0.05


class SensorClock:
    """The sensor's deadlines, event-loop time (`_clock`) and the offset that turns it into
    Unix time."""

    def __init__(
        self,
        on_expired: Callable[[DeadlineKey, float], None],
        extended: Callable[[DeadlineKey, float], float],
        heartbeat_timeout_s: float,
    ) -> None:
        resolution_s = min(DEADLINE_RESOLUTION_S, heartbeat_timeout_s / 100)
        self._deadlines = DeadlineQueue(on_expired, extended=extended, resolution_s=resolution_s)
        # The event loop's clock, bound on first use (the loop may not exist yet).
        self._clock: Callable[[], float] = self._bind_clock
        self._offset = 0.0  # see _wall_offset

    def _bind_clock(self) -> float:
        self._clock = self._deadlines.loop.time
        return self._clock()

    def _wall_offset(self) -> float:
        """Unix time minus event-loop time, to turn `last_seen` into a Unix time.

        Kept until the two clocks drift apart by a millisecond, so that a node's
        reported last heartbeat does not wobble by microseconds from one read to the next.
        """
        offset = wall_time() - self._clock()
        if abs(offset - self._offset) > WALL_OFFSET_TOLERANCE_S:
            self._offset = offset
        return self._offset
