"""The sensor's clocks: the event loop's, which its deadlines run on, and Unix time."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.domain import wall_time
from supervisor.sensor.deadlines import DeadlineQueue
from supervisor.sensor.nodes import DeadlineKey

WALL_OFFSET_TOLERANCE_S = 0.001


class SensorClock:
    """Event-loop time (`_clock`) and the offset that turns it into Unix time."""

    def __init__(self, deadlines: DeadlineQueue[DeadlineKey]) -> None:
        self._deadlines = deadlines
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
