"""Per checkpoint tier figures of a timeline: saves, loads, their costs, sizes and rates,
and the recoveries each tier served."""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence

from supervisor.goodput.model import (
    EMERGENCY_TIER,
    CheckpointLoaded,
    CheckpointSaved,
    TierStats,
    Timeline,
)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


MIB = 2**20


def _sizes(
    records: Sequence[CheckpointSaved | CheckpointLoaded],
) -> tuple[float | None, float | None]:
    """Mean size (bytes) over the records that have one, and mean throughput (MiB/s) over
    those with a size and a total time above zero."""
    sizes = [r.size_bytes for r in records if r.size_bytes is not None]
    rates = [
        r.size_bytes / r.total_s / MIB
        for r in records
        if r.size_bytes is not None and r.total_s is not None and r.total_s > 0
    ]
    return _mean(sizes), _mean(rates)


def tier_stats(timeline: Timeline, emergency: set[int]) -> tuple[TierStats, ...]:
    """Figures of each tier; ``emergency``: indices (into ``timeline.saves``) of the
    emergency checkpoints."""
    names = sorted({s.tier for s in timeline.saves} | {ld.tier for ld in timeline.loads})
    loads = sorted(timeline.loads, key=lambda ld: ld.time)
    load_times = [ld.time for ld in loads]
    recoveries: dict[str, int] = defaultdict(int)
    for f in timeline.failures:
        i = bisect.bisect_left(load_times, f.detected_at)
        if i < len(loads):
            recoveries[loads[i].tier] += 1
    out = []
    for name in names:
        saves = [(i, s) for i, s in enumerate(timeline.saves) if s.tier == name]
        # The emergency tier's cost is its own saves'; any other tier's, its periodic ones.
        periodic = [
            s.duration_s
            for i, s in saves
            if s.blocking and (i not in emergency or name == EMERGENCY_TIER)
        ]
        steps = sorted({s.step for _, s in saves})
        gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
        median_gap = _median([float(g) for g in gaps])
        served = [ld for ld in loads if ld.tier == name]
        tier_loads = [ld.duration_s for ld in served]
        save_bytes, save_rate = _sizes([s for _, s in saves])
        load_bytes, load_rate = _sizes(served)
        out.append(
            TierStats(
                tier=name,
                saves=len(saves),
                blocking_saves=sum(1 for _, s in saves if s.blocking),
                emergency_saves=sum(1 for i, _ in saves if i in emergency),
                mean_save_s=_mean([s.duration_s for _, s in saves]),
                mean_blocking_save_s=_mean(periodic),
                interval_steps=round(median_gap) if median_gap is not None else None,
                loads=len(tier_loads),
                mean_load_s=_mean(tier_loads),
                recoveries=recoveries.get(name, 0),
                mean_save_bytes=save_bytes,
                save_mib_per_s=save_rate,
                mean_load_bytes=load_bytes,
                load_mib_per_s=load_rate,
            )
        )
    return tuple(out)
