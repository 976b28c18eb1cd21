"""Samples each job's step from the sensor's picture, for goodput: cheap and periodic.

Heartbeats carry steps thousands of times a second across a fleet; writing each would
cost the hot path a database write. Instead, every ``period_s`` this task reads the step
the sensor already holds for each job and stores a sample only for the jobs whose step
moved (forwards, or back after a restart). A sample's time is when the sensor saw that
step first (its last advance), not when it was sampled, so sampling adds no error beyond
one heartbeat period. Samples that cannot be written are kept and written with the next.

This stays a loop of its own rather than a job of the supervisor's scheduler: what it
holds (the steps last sampled, the samples not written yet) lives in this replica's
memory and is written when the supervisor stops; there is nothing to store as a job or
to hand to another replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from supervisor.domain import ProgressSample

log = logging.getLogger(__name__)

#: Samples kept in memory while the database cannot take them (about 1 day per job at 10 s).
MAX_PENDING = 100_000


class ProgressSampler:
    def __init__(
        self,
        period_s: float,
        read: Callable[[], list[tuple[str, int, float]]],
        write: Callable[[Sequence[ProgressSample]], None],
    ) -> None:
        self.period_s = period_s
        self._read = read
        self._write = write
        self._last: dict[str, int] = {}
        self._pending: list[ProgressSample] = []

    def sample(self) -> list[ProgressSample]:
        """New samples since the previous call (jobs whose step changed)."""
        out = []
        for job, step, at in self._read():
            if self._last.get(job) == step:
                continue
            self._last[job] = step
            out.append(ProgressSample(job=job, step=step, time=datetime.fromtimestamp(at, UTC)))
        return out

    async def flush(self) -> None:
        """Sample now and write what is pending; on failure keep it for the next time."""
        self._pending.extend(self.sample())
        if len(self._pending) > MAX_PENDING:
            del self._pending[: len(self._pending) - MAX_PENDING]
            log.error("progress samples could not be written for long: dropped the oldest")
        if not self._pending:
            return
        batch = list(self._pending)
        await asyncio.to_thread(self._write, batch)
        del self._pending[: len(batch)]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cannot store %d progress samples; retrying", len(self._pending))
