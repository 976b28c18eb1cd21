"""Deadline-driven timers: fire a callback when a key's deadline passes.

Heartbeats push deadlines forward all the time, so pushing to the heap on every heartbeat
would be wasteful. Instead each key has at most one heap entry; when it pops early (the
key's deadline moved on), it is pushed again at the current deadline. The owner may also
move a deadline on without telling the queue at all: before firing, the queue asks
`extended(key, deadline)` for the key's latest deadline. A heartbeat then costs nothing
here (the sensor only notes the node's last heartbeat time), and only the earliest
deadline holds an event-loop timer, so the cost of watching N nodes does not grow with N
per period and lateness stays at the timer resolution.

Timers fire on a grid of `resolution_s`: every deadline within one step of it shares one
wake-up of the event loop, a deadline fired at most that late. Nodes spread over their
period would otherwise wake the loop once each (2,000 nodes every 5 s: about 115 times a
second, each wake-up of an idle loop some 30 us of CPU).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    """Calls `on_expired(key, deadline)` soon after `deadline` (event-loop time)."""

    def __init__(
        self,
        on_expired: Callable[[K, float], None],
        loop: asyncio.AbstractEventLoop | None = None,
        extended: Callable[[K, float], float] | None = None,
        resolution_s: float = 0.0,
    ) -> None:
        self._on_expired = on_expired
        self._resolution_s = resolution_s
        self._extended = extended
        self._loop = loop
        self._desired: dict[K, float] = {}
        self._scheduled: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def time(self) -> float:
        loop = self._loop or self.loop  # one frame less: called on every heartbeat
        return loop.time()

    def __len__(self) -> int:
        return len(self._desired)

    def __contains__(self, key: object) -> bool:
        return key in self._desired

    def deadline(self, key: K) -> float | None:
        return self._desired.get(key)

    def arm(self, key: K, deadline: float) -> None:
        """Set (or move) the deadline of `key`."""
        self._desired[key] = deadline
        scheduled = self._scheduled.get(key)
        if scheduled is None or deadline < scheduled:
            self._push(key, deadline)

    def disarm(self, key: K) -> None:
        self._desired.pop(key, None)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _push(self, key: K, deadline: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))
        self._scheduled[key] = deadline
        when = self._slot(deadline)
        if self._timer_at is None or when < self._timer_at:
            self._schedule(when)

    def _slot(self, deadline: float) -> float:
        """The grid's first point at or after `deadline`."""
        step = self._resolution_s
        if step <= 0:
            return deadline
        return max(deadline, math.ceil(deadline / step) * step)

    def _schedule(self, when: float) -> None:
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._run)
        self._timer_at = when

    def _run(self) -> None:
        self._timer = None
        self._timer_at = None
        heap = self._heap
        now = self.loop.time()
        while heap and heap[0][0] <= now and not self._closed:
            when, _, key = heapq.heappop(heap)
            if self._scheduled.get(key) != when:
                continue  # superseded by an earlier push for the same key
            del self._scheduled[key]
            wanted = self._desired.get(key)
            if wanted is None:
                continue  # disarmed
            if wanted > when:
                self._push(key, wanted)
                continue
            if self._extended is not None:
                wanted = max(wanted, self._extended(key, wanted))
                if wanted > now:  # moved on by its owner since it was armed
                    self._desired[key] = wanted
                    self._push(key, wanted)
                    continue
            del self._desired[key]
            self._on_expired(key, wanted)
            now = self.loop.time()
        if heap and not self._closed:
            self._schedule(self._slot(heap[0][0]))
