"""Goodput of a job, as the API and the metrics serve it: from the job's stored history
(events, actions, checkpoint reports, sampled steps) and the step the sensor holds now.

A long history takes a while to compute (see `python -m bench.goodput`: under a second
for a day of a job at one step per second), and dashboards poll: requests for the same
figures share one computation (`ResultCache`), and its result is served for max(1 s,
twice what it cost) before being computed again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from supervisor.domain import ProgressSample, utcnow
from supervisor.goodput.breakdown import compute_goodput
from supervisor.goodput.history import HistorySources, timeline_from_history
from supervisor.goodput.model import GoodputReport, Timeline
from supervisor.sensor import Sensor
from supervisor.store.roles import HistorySource

T = TypeVar("T")


@dataclass
class _Entry:
    computed_at: float  # monotonic
    fresh_for_s: float
    value: Any


class ResultCache:
    """One computation per key at a time; its result reused for max(min_age_s, 2 x cost)."""

    def __init__(self, min_age_s: float = 1.0, max_entries: int = 256) -> None:
        self.min_age_s = min_age_s
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._locks: dict[Hashable, asyncio.Lock] = {}

    async def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            entry = self._entries.get(key)
            if entry is not None and time.monotonic() - entry.computed_at < entry.fresh_for_s:
                value: T = entry.value
                return value
            started = time.monotonic()
            value = await asyncio.to_thread(compute)
            done = time.monotonic()
            self._entries[key] = _Entry(done, max(self.min_age_s, 2 * (done - started)), value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                old, _ = self._entries.popitem(last=False)
                old_lock = self._locks.get(old)
                if old_lock is not None and not old_lock.locked():
                    del self._locks[old]
            return value


class GoodputService:
    """Each job's goodput report, from `store` and `sensor`, computations shared."""

    def __init__(
        self, store: HistorySource, sensor: Sensor, cache: ResultCache | None = None
    ) -> None:
        self.store = store
        self.sensor = sensor
        self.cache = cache or ResultCache()

    async def report(
        self, job: str, *, points: int = 0, reference_step_time_s: float | None = None
    ) -> tuple[GoodputReport, HistorySources]:
        """The job's report (with `points` of series) and what it was built from."""
        live = self.live_step(job)
        return await self.cache.get(
            (job, points, reference_step_time_s),
            lambda: self.compute(
                job, points=points, reference_step_time_s=reference_step_time_s, live=live
            ),
        )

    def compute(
        self,
        job: str,
        *,
        points: int = 0,
        reference_step_time_s: float | None = None,
        live: Sequence[ProgressSample] = (),
    ) -> tuple[GoodputReport, HistorySources]:
        """Compute it now (runs in a thread). `live`: the step the sensor holds, newer than
        the last stored sample by up to a sample period."""
        timeline, sources = self.timeline(job, live=live)
        report = compute_goodput(
            timeline, reference_step_time_s=reference_step_time_s, series_points=points
        )
        return report, sources

    def timeline(
        self, job: str, *, live: Sequence[ProgressSample] = ()
    ) -> tuple[Timeline, HistorySources]:
        """The job's timeline from its stored history and `live` (runs in a thread)."""
        history = self.store.job_history(job)
        view = self.sensor.job_view(job) or history.job
        timeline, sources = timeline_from_history(
            job,
            created_at=history.created_at,
            events=history.events,
            actions=history.actions,
            checkpoints=history.checkpoints,
            samples=[*history.samples, *live],
            now=utcnow(),
            max_replicas=view.max_num_dp_replicas if view is not None else None,
            reported_bound_s=self.sensor.settings.agent_clock_skew_s,
        )
        # The store summarises the ranks' reports of one checkpoint: count what is stored.
        return timeline, replace(sources, checkpoint_reports=history.checkpoint_reports)

    def live_step(self, job: str) -> list[ProgressSample]:
        """The job's newest step as the sensor holds it now (call on the event loop)."""
        return [
            ProgressSample(job=name, step=step, time=datetime.fromtimestamp(at, UTC))
            for name, step, at in self.sensor.job_steps()
            if name == job
        ]
