"""Stragglers: ranks whose own work per step stays slower than their job's.

Each worker reports `compute_s`: the seconds its steps spend in its own work (forward,
backward, data), before it waits for the others in a collective. In a synchronous job
every rank steps at the pace of the slowest, so step rates cannot tell a straggler; the
time before the collective can: the straggler's grows, the others' does not.

Every check (one heartbeat period), each rank that stepped since the last check gives its
newest report as one sample: a rank that did not step (a stalled job, ranks waiting for a
new world) gives none, or its last step's time, one preempted forward on a busy machine,
would fill its window while the job waits and make it a straggler. A rank's
score is the median of its samples within `window_s`, over the median of those medians
across the job's ranks: a whole job that slows down (a slow data loader, a shared file
system) keeps every score near 1, and one noisy sample moves no median. A rank whose score
stays at or above `threshold` for `window_s` is a straggler; one that stays below it for
`window_s` again has recovered. Nothing is scored with fewer than `MIN_RANKS` ranks.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

#: With fewer ranks reporting, a median says nothing of what is typical.
MIN_RANKS = 3


@dataclass(frozen=True, slots=True)
class StragglerParams:
    threshold: float  # score at which a rank counts as slow (1.2: 20% slower)
    window_s: float  # how long a rank must stay slow (or fast again) to be reported


@dataclass(slots=True)
class _Rank:
    node: str
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, compute_s)
    last_step: int | None = None  # the step of the newest sample
    slow_since: float | None = None
    fast_since: float | None = None
    reported: bool = False  # a straggler event is out and no recovery since

    def median(self, now: float, window_s: float) -> float | None:
        while self.samples and self.samples[0][0] < now - window_s:
            self.samples.popleft()
        if not self.samples:
            return None
        return statistics.median(value for _, value in self.samples)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A change to report: `slow` True for a straggler, False for its recovery."""

    job: str
    rank: int
    node: str
    slow: bool
    score: float
    compute_s: float
    typical_s: float
    since: float  # when the rank became slow (or fast again), event-loop time


class StragglerScorer:
    def __init__(self, params: StragglerParams) -> None:
        self.params = params
        self._jobs: dict[str, dict[int, _Rank]] = {}

    def observe(
        self, job: str, rank: int, node: str, compute_s: float, now: float, step: int | None
    ) -> None:
        """The rank's newest report, of `step`: a sample unless it is that of the last one."""
        ranks = self._jobs.setdefault(job, {})
        record = ranks.get(rank)
        if record is None or record.node != node:  # a new rank, or moved to a new node
            record = ranks[rank] = _Rank(node)
        if step is not None and step == record.last_step:
            return  # no step since: the same report again
        record.last_step = step
        record.samples.append((now, compute_s))

    def forget(self, job: str, rank: int | None = None) -> None:
        if rank is None:
            self._jobs.pop(job, None)
        else:
            self._jobs.get(job, {}).pop(rank, None)

    def scores(self, job: str, now: float) -> dict[int, float]:
        """Each rank's current score (tests, the dashboard)."""
        medians, typical = self._medians(job, now)
        if typical is None:
            return {}
        return {rank: median / typical for rank, median in medians.items()}

    def _medians(self, job: str, now: float) -> tuple[dict[int, float], float | None]:
        window = self.params.window_s
        medians: dict[int, float] = {}
        for rank, record in self._jobs.get(job, {}).items():
            median = record.median(now, window)
            if median is not None:
                medians[rank] = median
        if len(medians) < MIN_RANKS:
            return medians, None
        typical = statistics.median(medians.values())
        return medians, typical if typical > 0 else None

    def evaluate(self, now: float) -> list[Verdict]:
        """The stragglers and recoveries that became due by `now`."""
        out: list[Verdict] = []
        threshold, window = self.params.threshold, self.params.window_s
        for job in list(self._jobs):
            medians, typical = self._medians(job, now)
            if typical is None:
                # Too few ranks stepping to score (the job stalled): a rank stays slow, or
                # fast again, only while it is seen to.
                for record in self._jobs[job].values():
                    record.slow_since = record.fast_since = None
                continue
            for rank, median in medians.items():
                record = self._jobs[job][rank]
                score = median / typical
                if score >= threshold:
                    record.fast_since = None
                    if record.slow_since is None:
                        record.slow_since = now
                    if not record.reported and now - record.slow_since >= window:
                        record.reported = True
                        out.append(
                            Verdict(
                                job,
                                rank,
                                record.node,
                                True,
                                score,
                                median,
                                typical,
                                record.slow_since,
                            )
                        )
                else:
                    record.slow_since = None
                    if record.reported and record.fast_since is None:
                        record.fast_since = now
                    if (
                        record.reported
                        and record.fast_since is not None
                        and now - record.fast_since >= window
                    ):
                        record.reported = False
                        out.append(
                            Verdict(
                                job,
                                rank,
                                record.node,
                                False,
                                score,
                                median,
                                typical,
                                record.fast_since,
                            )
                        )
                        record.fast_since = None
        return out
