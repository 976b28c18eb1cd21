"""The sensor's clocks: the event loop's, which its deadlines run on, and Unix time."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.domain import wall_time
from supervisor.sensor.deadlines import DeadlineQueue
from supervisor.sensor.nodes import DeadlineKey

WALL_OFFSET_TOLERANCE_S = 0.001
#: Reads of the two clocks for one offset at most: a read that the scheduler interrupted
#: between the clocks is read again (see `SensorClock._measured_offset`).
OFFSET_READS = 3
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
        offset = self._measured_offset()
        if abs(offset - self._offset) > WALL_OFFSET_TOLERANCE_S:
            self._offset = offset
        return self._offset

    def _measured_offset(self) -> float:
        """The offset read between two reads of the loop's clock, against its midpoint.

        A process preempted between its two clocks' reads (a loaded machine: for
        milliseconds) reads an offset off by as long, past the tolerance: every node's
        last heartbeat would move by that much, and back at the next read, each time
        every view built again. So the read whose loop-clock reads lie closest together
        of up to OFFSET_READS is kept.
        """
        best_width, best = float("inf"), 0.0
        for _ in range(OFFSET_READS):
            before = self._clock()
            wall = wall_time()
            width = self._clock() - before
            if width < best_width:
                best_width, best = width, wall - (before + width / 2)
            if width <= WALL_OFFSET_TOLERANCE_S / 10:
                break
        return best
